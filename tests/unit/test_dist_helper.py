"""tests/dist.py's run_ranks launches again when the rendezvous port was taken before the ranks bound it
(another test's process, under pytest-xdist or on a busy CI machine, picked the same free port)."""
import socket

import tests.dist as dist_helper


def _rank_and_world(rank, world):
    return rank, world


def test_a_taken_rendezvous_port_is_retried_on_another(tmp_path, monkeypatch):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    real, calls = dist_helper.free_port, []

    def first_port_taken():
        calls.append(None)
        return taken.getsockname()[1] if len(calls) == 2 else real()  # the first launch's rendezvous port
    monkeypatch.setattr(dist_helper, "free_port", first_port_taken)
    try:
        assert dist_helper.run_ranks(2, _rank_and_world, tmp_dir=tmp_path) == [(0, 2), (1, 2)]
    finally:
        taken.close()
    assert len(calls) == 4  # (a folder name and a port) for each of two launches
