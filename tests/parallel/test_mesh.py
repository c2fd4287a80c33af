"""gpipe.parallel.mesh: the job's processes and its store (the pipeline over processes:
test_distributed.py; the launcher's store: test_launch.py)."""

from __future__ import annotations

import pytest

from gpipe.parallel.launch import free_port
from gpipe.parallel.mesh import _store
from launch_probes import listening


@pytest.mark.parametrize("address", ["127.0.0.1", "localhost"])
def test_rank_0s_store_listens_on_loopback_when_master_addr_is_loopback(address):
    """MASTER_ADDR set by hand: a loopback address means every process is on this host."""
    store = _store(0, 1, address, free_port(), timeout=5)
    try:
        assert [a for a, _ in listening(store.port)] == ["0100007F"]
    finally:
        del store
