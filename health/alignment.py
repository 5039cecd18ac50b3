"""Bit-wise alignment test (ByteRobust's MiniGPT check).

A tiny GPT (2 layers, fixed weights from a closed formula, fixed tokens) runs
one training step - forward, backward, SGD update - under deterministic
settings; the SHA-256 of the loss, the gradients and the updated weights must
equal the reference digest of the platform (device model, torch, CUDA), and
must not change between repeats. A machine with silent data corruption gives
another digest.

torch is imported only inside the functions that compute: the judging helpers
here are torch-free, and ``run_in_subprocess`` keeps the import (seconds) and
the determinism settings out of the calling process. Run
``python -m ft_launch.health.alignment --json`` on a known-good node to print the
reference digests for its platform.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

VOCAB, WIDTH, HEADS, LAYERS, SEQ, BATCH = 64, 32, 2, 2, 16, 2
LEARNING_RATE = 0.05


@dataclass(frozen=True)
class AlignmentRun:
    device: str
    platform: str
    digests: tuple[str, ...]     # one per repeat
    seconds: float

    @property
    def deterministic(self) -> bool:
        return len(set(self.digests)) == 1


# --------------------------------------------------------------------------- judging (pure)


def judge_run(run: AlignmentRun, references: Mapping[str, str]) -> str | None:
    """None when the run is aligned, else a short reason."""
    if not run.deterministic:
        return f"alignment nondeterministic on {run.device}"
    expected = references.get(run.platform)
    if expected is not None and run.digests[0] != expected:
        return f"alignment mismatch on {run.device}"
    return None


def digest_outliers(digests: Mapping[str, str]) -> list[str]:
    """Keys (nodes) whose digest differs from the majority's (stop-time diagnosis
    across machines of the same platform, when no reference is pinned)."""
    if not digests:
        return []
    majority, _ = Counter(digests.values()).most_common(1)[0]
    return sorted(key for key, digest in digests.items() if digest != majority)


# --------------------------------------------------------------------------- the model (torch)


def _formula_tensor(torch: Any, shape: Sequence[int], salt: int, scale: float) -> Any:
    """Weights from a closed formula: identical on every machine, no RNG involved."""
    count = 1
    for size in shape:
        count *= size
    index = torch.arange(count, dtype=torch.float64)
    values = torch.sin(index * 0.7071 + salt * 1.618) * scale
    return values.to(torch.float32).reshape(*shape)


def _weights(torch: Any, device: str) -> dict[str, Any]:
    shapes = {"embed": (VOCAB, WIDTH), "pos": (SEQ, WIDTH), "out": (WIDTH, VOCAB)}
    for layer in range(LAYERS):
        shapes.update({f"qkv{layer}": (WIDTH, 3 * WIDTH), f"proj{layer}": (WIDTH, WIDTH),
                       f"up{layer}": (WIDTH, 4 * WIDTH), f"down{layer}": (4 * WIDTH, WIDTH)})
    return {name: _formula_tensor(torch, shape, salt, 0.2).to(device).requires_grad_()
            for salt, (name, shape) in enumerate(sorted(shapes.items()))}


def _loss(torch: Any, w: Mapping[str, Any], tokens: Any) -> Any:
    functional = torch.nn.functional
    x = w["embed"][tokens[:, :-1]] + w["pos"][: SEQ - 1]
    mask = torch.ones(SEQ - 1, SEQ - 1, device=x.device).triu(1).bool()
    for layer in range(LAYERS):
        h = functional.layer_norm(x, (WIDTH,))
        q, k, v = (h @ w[f"qkv{layer}"]).split(WIDTH, dim=-1)
        split = [t.reshape(BATCH, SEQ - 1, HEADS, WIDTH // HEADS).transpose(1, 2)
                 for t in (q, k, v)]
        scores = (split[0] @ split[1].transpose(-1, -2)) / (WIDTH // HEADS) ** 0.5
        attn = scores.masked_fill(mask, float("-inf")).softmax(-1) @ split[2]
        x = x + attn.transpose(1, 2).reshape(BATCH, SEQ - 1, WIDTH) @ w[f"proj{layer}"]
        x = x + functional.gelu(functional.layer_norm(x, (WIDTH,)) @ w[f"up{layer}"]) \
            @ w[f"down{layer}"]
    logits = functional.layer_norm(x, (WIDTH,)) @ w["out"]
    return functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def training_step_digest(device: str = "cpu", corrupt: bool = False) -> str:
    """One deterministic training step; the SHA-256 of loss, gradients and new weights."""
    import hashlib

    import torch

    weights = _weights(torch, device)
    if corrupt:  # simulated SDC: the lowest mantissa bit of one weight flips
        with torch.no_grad():
            bits = weights["embed"].view(torch.int32)
            bits[3, 5] ^= 1
    tokens = (torch.arange(BATCH * SEQ) * 7 + 3).remainder(VOCAB).reshape(BATCH, SEQ).to(device)
    loss = _loss(torch, weights, tokens)
    loss.backward()
    digest = hashlib.sha256(loss.detach().cpu().numpy().tobytes())
    with torch.no_grad():
        for name in sorted(weights):
            weight = weights[name]
            digest.update(weight.grad.cpu().numpy().tobytes())
            weight -= LEARNING_RATE * weight.grad
            digest.update(weight.cpu().numpy().tobytes())
    return digest.hexdigest()


def platform_key(device: str) -> str:
    import platform

    import torch

    if device.startswith("cuda"):
        name = torch.cuda.get_device_name(torch.device(device)).replace(" ", "_")
        return f"cuda-{name}-torch{torch.__version__}-cuda{torch.version.cuda}"
    return f"cpu-{platform.machine()}-torch{torch.__version__}"


def _deterministic_settings() -> None:
    # Must precede CUDA initialisation: cuBLAS reads it when its handle is created.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch

    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = False
    torch.set_num_threads(1)  # CPU reductions split by thread count otherwise


def run_devices(devices: Sequence[str], repeats: int, corrupt: bool) -> list[AlignmentRun]:
    _deterministic_settings()
    import torch

    if list(devices) == ["all"]:
        devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())] or ["cpu"]
    runs = []
    for device in devices:
        start = time.monotonic()
        digests = tuple(training_step_digest(device, corrupt) for _ in range(repeats))
        runs.append(AlignmentRun(device, platform_key(device), digests,
                                 time.monotonic() - start))
    return runs


# --------------------------------------------------------------------------- subprocess shell


def run_in_subprocess(devices: Sequence[str] = ("cpu",), repeats: int = 2,
                      corrupt: bool = False, timeout: float = 300.0) -> list[AlignmentRun]:
    """Run the test in a fresh interpreter (torch import, determinism settings, timeout)."""
    argv = [sys.executable, "-m", "ft_launch.health.alignment", "--json", "--repeats", str(repeats),
            "--device", *devices, *(["--corrupt"] if corrupt else [])]
    done = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise RuntimeError(f"alignment test exited {done.returncode}: "
                           f"{done.stderr.strip()[-300:]}")
    return [AlignmentRun(r["device"], r["platform"], tuple(r["digests"]), r["seconds"])
            for r in json.loads(done.stdout)["runs"]]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ft_launch.health.alignment",
                                     description="Bit-wise alignment test: print the digest "
                                                 "of one deterministic MiniGPT training step.")
    parser.add_argument("--device", nargs="+", default=["cpu"],
                        help="cpu, cuda:N, or 'all' (every GPU)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--corrupt", action="store_true", help="simulate silent data corruption")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    runs = run_devices(args.device, args.repeats, args.corrupt)
    if args.json:
        json.dump({"runs": [{"device": r.device, "platform": r.platform,
                             "digests": list(r.digests), "seconds": r.seconds} for r in runs]},
                  sys.stdout)
        sys.stdout.write("\n")
    else:
        for run in runs:
            sys.stdout.write(f"{run.platform} = \"{run.digests[0]}\"  # {run.device}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
