"""Identifiers and the per-job secret that authenticates every endpoint."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

SECRET_BYTES = 32


def new_job_secret() -> str:
    """A fresh per-job secret, hex encoded so it travels in an environment variable."""
    return secrets.token_hex(SECRET_BYTES)


def sign(secret: str, *parts: bytes) -> bytes:
    """HMAC-SHA256 over ``parts`` (length-prefixed so parts cannot be re-split)."""
    mac = hmac.new(bytes.fromhex(secret), digestmod=hashlib.sha256)
    for part in parts:
        mac.update(len(part).to_bytes(8, "big"))
        mac.update(part)
    return mac.digest()


def verify(secret: str, signature: bytes, *parts: bytes) -> bool:
    return hmac.compare_digest(sign(secret, *parts), signature)


@dataclass(frozen=True, order=True)
class StepRef:
    """One Slurm job step: ``JOB.STEP``."""

    job_id: str
    step_id: str

    def __str__(self) -> str:
        return f"{self.job_id}.{self.step_id}"
