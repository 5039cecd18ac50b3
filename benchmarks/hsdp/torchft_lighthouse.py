"""torchft's lighthouse (from the wheel) for the torchft arm, on a loopback port
the kernel picks; run with the torchft environment's python.

    python benchmarks/hsdp/torchft_lighthouse.py --min-replicas 3 --address-file F

Writes its address to ``F`` once it listens and serves until its standard input
closes (the driver holds the pipe: if the driver dies, so does the lighthouse).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from torchft._torchft import LighthouseServer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--min-replicas", type=int, required=True)
    parser.add_argument("--join-timeout-ms", type=int, default=60_000)
    parser.add_argument("--address-file", type=Path, required=True)
    args = parser.parse_args(argv)
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=args.min_replicas,
                              join_timeout_ms=args.join_timeout_ms)
    # address() names the host by its hostname; the replicas dial loopback only
    port = server.address().rsplit(":", 1)[1]
    tmp = args.address_file.with_suffix(".tmp")
    tmp.write_text(f"http://127.0.0.1:{port}")
    os.replace(tmp, args.address_file)
    try:
        sys.stdin.read()
    finally:
        server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
