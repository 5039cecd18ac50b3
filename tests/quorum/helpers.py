"""Settings shared by the socket tests."""

from __future__ import annotations

from ft_launch.config import QuorumConfig

#: Short timeouts keep the suite fast; long enough against a busy 2-core box.
FAST_CONFIG = QuorumConfig(heartbeat_interval=0.05, election_timeout=0.4, member_timeout=1.2,
                           join_timeout=0.6)


def round_timeout(config: QuorumConfig = FAST_CONFIG) -> float:
    """How long a test waits for a round before calling it lost (on an idle machine;
    ``wait_until`` stretches it by load): a join window plus a leader failover, the
    agent's own ``default_timeout``, four times over (split votes, a resent join)."""
    return 4 * (config.join_timeout + config.member_timeout + 4 * config.election_timeout)
