"""Settings shared by the socket tests."""

from __future__ import annotations

from ftcore.config import QuorumConfig

#: Short timeouts keep the suite fast; long enough against a busy 2-core box.
FAST_CONFIG = QuorumConfig(heartbeat_interval=0.05, election_timeout=0.4, member_timeout=1.2,
                           join_timeout=0.6)
