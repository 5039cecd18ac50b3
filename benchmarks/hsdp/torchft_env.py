"""The torchft arm's own Python environment, created on first use.

A venv with ``--system-site-packages`` (it sees this machine's torch, numpy and
the repo) under ``$XDG_CACHE_HOME/ft-launch/torchft-0.2.0`` (``~/.cache`` when
unset), holding ``torchft==0.2.0`` installed with ``--no-deps`` and the only
dependencies its import needs: ``torchft/__init__.py`` imports ``torchft.otel``,
which imports OpenTelemetry's API, SDK and OTLP HTTP log exporter (the wheel's
own requirements, ``>=1.39.0``). Every install runs under a constraint pinning
torch to the installed version, so pip can never replace it.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import venv
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

log = logging.getLogger(__name__)

TORCHFT_VERSION = "0.2.0"
IMPORT_DEPS = ("opentelemetry-api>=1.39.0", "opentelemetry-sdk>=1.39.0",
               "opentelemetry-exporter-otlp-proto-http>=1.39.0")
PROBE = ("import json, torch, torchft; from importlib.metadata import version; "
         "print(json.dumps({'torch': torch.__version__, 'torch_file': torch.__file__, "
         "'torchft': version('torchft'), 'torchft_file': torchft.__file__}))")


class TorchftUnavailable(Exception):
    """The torchft environment could not be made or does not import; says why."""


@dataclass(frozen=True)
class TorchftEnv:
    python: Path
    torchft: str
    torch: str
    torch_file: str
    created: bool

    def describe(self) -> dict[str, object]:
        return {"python": str(self.python), "torchft": self.torchft, "torch": self.torch,
                "torch_file": self.torch_file, "created_now": self.created,
                "install": f"pip install --no-deps torchft=={TORCHFT_VERSION}; pip install "
                           f"-c <torch=={_torch_pin()}> {' '.join(IMPORT_DEPS)}"}


def default_dir() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "ft-launch" / f"torchft-{TORCHFT_VERSION}"


def ensure(env_dir: Path, install_timeout: float = 900.0) -> TorchftEnv:
    """The environment at ``env_dir``, made anew if it does not import torchft."""
    python = env_dir / "bin" / "python"
    probe = _probe(python)
    created = False
    if probe is None:
        log.info("creating the torchft %s environment in %s", TORCHFT_VERSION, env_dir)
        _create(env_dir, python, install_timeout)
        created = True
        probe = _probe(python)
        if probe is None:
            raise TorchftUnavailable(f"{python} still cannot import torchft after installing; "
                                     f"see {env_dir / 'install.log'}")
    if probe["torchft"] != TORCHFT_VERSION:
        raise TorchftUnavailable(f"{env_dir} holds torchft {probe['torchft']}, not "
                                 f"{TORCHFT_VERSION}; remove it to have it made again")
    if probe["torch"] != version("torch") or Path(probe["torch_file"]).is_relative_to(env_dir):
        raise TorchftUnavailable(f"{env_dir} imports torch {probe['torch']} from "
                                 f"{probe['torch_file']}, not this machine's {version('torch')}; "
                                 "remove it to have it made again")
    return TorchftEnv(python, probe["torchft"], probe["torch"], probe["torch_file"], created)


def _torch_pin() -> str:
    return version("torch").split("+")[0]


def _probe(python: Path) -> dict[str, str] | None:
    if not python.exists():
        return None
    result = subprocess.run([str(python), "-c", PROBE], capture_output=True, text=True,
                            timeout=120, check=False)
    if result.returncode != 0:
        log.info("torchft environment probe failed: %s", result.stderr.strip()[-500:])
        return None
    return json.loads(result.stdout.strip().splitlines()[-1])


def _create(env_dir: Path, python: Path, timeout: float) -> None:
    """A fresh venv (whatever was there did not import torchft), then the installs."""
    venv.EnvBuilder(system_site_packages=True, with_pip=True, clear=True).create(env_dir)
    constraints = env_dir / "constraints.txt"
    constraints.write_text(f"torch=={_torch_pin()}\n")
    pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check",
           "-c", str(constraints)]
    with (env_dir / "install.log").open("a") as out:
        for argv in ([*pip, "--no-deps", f"torchft=={TORCHFT_VERSION}"], [*pip, *IMPORT_DEPS]):
            out.write(f"$ {' '.join(argv)}\n")
            out.flush()
            try:
                code = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT,
                                      timeout=timeout, check=False).returncode
            except subprocess.TimeoutExpired as exc:
                raise TorchftUnavailable(f"{' '.join(argv)} ran past {timeout:.0f} s") from exc
            if code:
                raise TorchftUnavailable(f"{' '.join(argv)} failed (exit {code}); see "
                                         f"{env_dir / 'install.log'}")


if __name__ == "__main__":   # make (or check) the environment by hand
    logging.basicConfig(level="INFO")
    print(json.dumps(ensure(Path(sys.argv[1]) if len(sys.argv) > 1 else default_dir()).describe(),
                     indent=2))
