"""Where peer copies go (`peer_copies.peers_of`), the options that ask for them, and how a failed transfer ends; in
one process."""

from __future__ import annotations

import pytest

import xla_tensorstore_ckpt as xtc
from xla_tensorstore_ckpt.checkpoint_manager import peer_copies
from xla_tensorstore_ckpt.core import tunables
from xla_tensorstore_ckpt.core.errors import UsageError


def test_default_peers_are_the_farthest_processes_in_index_order():
    assert [peer_copies.peers_of(p, 4, 2) for p in range(4)] == [[2], [3], [0], [1]]
    assert peer_copies.peers_of(1, 8, 4) == [3, 5, 7]
    assert peer_copies.peers_of(0, 4, 1) == []


def test_peers_are_in_other_failure_domains_than_the_process_and_each_other():
    domain = {0: "vm0", 1: "vm0", 2: "vm1", 3: "vm1", 4: "vm2", 5: "vm2"}.__getitem__
    assert peer_copies.peers_of(0, 6, 3, domain) == [2, 4]
    assert peer_copies.peers_of(3, 6, 2, domain) == [4]
    for p in range(6):
        chosen = peer_copies.peers_of(p, 6, 3, domain)
        assert len({domain(q) for q in [p, *chosen]}) == 3


def test_too_few_processes_or_domains_are_refused():
    with pytest.raises(UsageError, match="needs at least 3 processes"):
        peer_copies.peers_of(0, 2, 3)
    with pytest.raises(UsageError, match="other failure domains"):
        peer_copies.peers_of(0, 4, 2, lambda p: "one rack")


def test_options_check_local_replication(tmp_path):
    with pytest.raises(ValueError, match="local_replication needs local_directory"):
        xtc.CheckpointManagerOptions(local_replication=2)
    for bad in (0, None, 1.5, True):
        with pytest.raises(ValueError, match="local_replication"):
            xtc.CheckpointManagerOptions(local_directory=str(tmp_path), local_replication=bad)
    with pytest.raises(ValueError, match="local_failure_domain must be callable"):
        xtc.CheckpointManagerOptions(local_directory=str(tmp_path), local_replication=2, local_failure_domain=3)


def test_a_single_process_cannot_replicate(tmp_path):
    options = xtc.CheckpointManagerOptions(local_directory=str(tmp_path / "local"), local_replication=2)
    with pytest.raises(UsageError, match="needs at least 2 processes"):
        xtc.CheckpointManager(str(tmp_path / "root"), options)


class _Exchanges:
    """A coordinator of one process (index 1) whose exchanges are recorded, the first failing when waited for
    (unless `fail` is False)."""

    index = 1

    def __init__(self, fail: bool = True):
        self.started, self.waited, self.fail = [], [], fail
        self.received = []  # the arrays each exchange received into

    def start_exchange(self, sends, receives, what):
        number = len(self.started)
        self.started.append(number)
        self.received += [a for arrays in receives.values() for a in arrays]
        outer = self

        class Pending:
            def wait(self):
                outer.waited.append(number)
                if number == 0 and outer.fail:
                    raise xtc.CoordinationError("process 1: transfer with process 0 failed (it died)", process=0)

        return Pending()


@pytest.fixture
def small_rounds():
    """Rounds of 200 bytes in pieces of 100: a file of 1000 bytes takes 10 rounds."""
    with tunables.overridden(peer_piece_bytes=100, peer_round_bytes=200):
        yield


def test_a_failed_round_waits_for_the_round_in_flight_before_raising(tmp_path, small_rounds):
    """Round 1 is started before round 0 is waited for; when round 0 fails, round 1's messages are waited out
    before the error is raised, so that none are left to pair up with the next transfer's on the group."""
    files = peer_copies.StepFiles(0, 1, (("model/data", 1000),), (0,))
    transfer = peer_copies.Transfer(0, 1, files, ("model/data",))
    coordinator = _Exchanges()
    with pytest.raises(xtc.CoordinationError, match="transfer with process 0 failed"):
        peer_copies.transfer(coordinator, [transfer], {}, {0: str(tmp_path)}, "step 1")
    assert coordinator.started == [0, 1] and coordinator.waited == [0, 1]


def test_a_transfer_reuses_the_round_areas_of_the_last_one_that_succeeded(tmp_path, small_rounds):
    """Each local step is replicated: the transfers of a training loop receive into the same two areas instead
    of faulting in fresh ones; a failed transfer's areas (a message may still arrive in them) are not kept."""
    files = peer_copies.StepFiles(0, 1, (("model/data", 1000),), (0,))
    transfer = peer_copies.Transfer(0, 1, files, ("model/data",))

    def received(coordinator):
        return [a.base if a.base is not None else a for a in coordinator.received]

    first, second, failed, after = _Exchanges(fail=False), _Exchanges(fail=False), _Exchanges(), _Exchanges(False)
    peer_copies.transfer(first, [transfer], {}, {0: str(tmp_path / "a")}, "step 1")
    peer_copies.transfer(second, [transfer], {}, {0: str(tmp_path / "b")}, "step 2")
    assert {id(a) for a in received(second)} == {id(a) for a in received(first)} and len(received(first)) == 10
    with pytest.raises(xtc.CoordinationError):
        peer_copies.transfer(failed, [transfer], {}, {0: str(tmp_path / "c")}, "step 3")
    peer_copies.transfer(after, [transfer], {}, {0: str(tmp_path / "d")}, "step 4")
    assert not {id(a) for a in received(after)} & {id(a) for a in received(failed)}


def test_a_file_that_cannot_be_written_is_given_up_and_every_round_still_received(tmp_path, small_rounds):
    """The receiver cannot write the files (a full disk, here a file where their directory should be): it keeps
    receiving every round, since its sender would otherwise wait for it, and returns the error naming the file,
    the step and the sender, with the files marked damaged, for its caller to raise once nobody waits."""
    files = peer_copies.StepFiles(0, 1, (("model/data", 1000), ("model/empty", 0)), (0, 0))
    transfer = peer_copies.Transfer(0, 1, files, ("model/data", "model/empty"))
    (tmp_path / "model").write_text("not a directory")
    coordinator = _Exchanges(fail=False)
    crcs, error = peer_copies.transfer(coordinator, [transfer], {}, {0: str(tmp_path)}, "step 1")
    assert coordinator.started == coordinator.waited == list(range(10))  # 10 rounds of 100 bytes
    assert crcs == {0: [peer_copies.file_transfer.DAMAGED, peer_copies.file_transfer.DAMAGED]}
    assert isinstance(error, xtc.StorageError)
    assert f"could not write {tmp_path / 'model' / 'data'} of step 1 received from process 0" in str(error)
