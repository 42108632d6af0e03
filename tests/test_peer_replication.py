"""Peer-replicated local tiers (`local_replication=2`) with four processes over gloo, each with its own local
directory (tests/scripts/peer_replication.py: host h's steps are copied to host h + 2 mod 4). A wiped host
resumes from the newest local step with its step fetched from its peer and nothing read from the persistent
tier; two hosts holding each other's copies wiped → the persistent step; a damaged chunk → only its file comes
from the peer; a process killed while replicating → that step is not counted as replicated; processes on other
hosts after a restart repair from the copy of the step their host holds."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from forked import launch_job

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "peer_replication.py")


def run(mode: str, root, local_base, *args: str, hosts: str = "0,1,2,3", expect_ok: bool = True,
        layout: str = "fsdp", piece_bytes: int | None = None, unreadable: str | None = None,
        fsize: str | None = None, fsize_from: int | None = None, unlistable: int | None = None,
        incremental: bool = False) -> list[dict]:
    env = {"XTC_HOSTS": hosts, "XTC_LAYOUT": layout, "XTC_INCREMENTAL": "1" if incremental else "0"}
    if piece_bytes is not None:
        env["XTC_PIECE_BYTES"] = str(piece_bytes)
    if unreadable is not None:
        env["XTC_UNREADABLE"] = unreadable
    if fsize is not None:
        env["XTC_FSIZE"] = fsize
    if fsize_from is not None:
        env["XTC_FSIZE_FROM"] = str(fsize_from)
    if unlistable is not None:
        env["XTC_UNLISTABLE"] = str(unlistable)
    results = launch_job(SCRIPT, 4, mode, str(root), str(local_base), *args, env=env)
    if expect_ok:
        for r in results:
            assert r["returncode"] == 0, r["stderr"][-3000:]
    return results


def lines(results: list[dict]) -> list[dict]:
    return [r["lines"][-1] for r in results]


def resumed_step_2(r: dict, tier: str | None = None) -> list[str]:
    """Assert that process `r` restored step 2 with every value exact (from `tier`, if given, as its log says);
    its warnings of skipping step 3 of the local tier."""
    assert r["step"] == 2 and r["equal"] and r["position"] == 20, r
    if tier is not None:
        assert any(f"restored step 2 from the {tier} tier" in line for line in r["logs"]), r["logs"]
    return [w for w in r["warnings"] if w.startswith("skipping step 3 of the local tier")]


def draw_after_seed(seed: int) -> float:
    return torch.rand(1, generator=torch.Generator().manual_seed(seed)).item()


def tree_bytes(path) -> dict[str, int]:
    return {os.path.relpath(os.path.join(d, n), path): os.path.getsize(os.path.join(d, n))
            for d, _, names in os.walk(path) for n in names}


@pytest.fixture
def saved(tmp_path):
    root, local_base = tmp_path / "persistent", tmp_path / "local"
    for r in lines(run("save", root, local_base)):
        assert r["error"] is None and r["local"] == [2, 3] and r["persistent"] == [2], r
        replicated = [e for e in r["events"] if e["kind"] == "peer_copies_committed"]
        assert [e["step"] for e in replicated] == [1, 2, 3]
        assert replicated[-1]["details"]["holders"] == {"0": [2], "1": [3], "2": [0], "3": [1]}
    return root, local_base


@pytest.fixture
def saved_dp(tmp_path):
    """The DP layout saved (host h holds row shard h % 2: replicas 0 and 2, 1 and 3)."""
    root, local_base = tmp_path / "persistent", tmp_path / "local"
    for r in lines(run("save", root, local_base, layout="dp")):
        assert r["error"] is None and r["local"] == [2, 3], r
    return root, local_base


def hide_persistent_data(root) -> None:
    """Keep the persistent step listed but make every read of its items fail: a restore that reads from it
    cannot succeed, so a successful one read nothing there."""
    for item in ("model", "data_loader", "rng"):
        shutil.rmtree(root / "2" / item)


def test_copies_are_the_writers_files_and_retention_keeps_the_local_count(saved):
    _, local_base = saved
    for host in range(4):
        writer = (host + 2) % 4
        copies = local_base / f"host{host}" / "peer_copies" / str(writer)
        assert sorted(os.listdir(copies)) == ["2", "3"]  # local_max_to_keep=2: step 1's copy went with step 1
        for step in ("2", "3"):
            copied = tree_bytes(copies / step)
            assert copied.pop("copy.json") > 0
            assert copied == tree_bytes(local_base / f"host{writer}" / step)  # disk: k x its own shard bytes
            for name in copied:
                assert (copies / step / name).read_bytes() == (local_base / f"host{writer}" / step / name).read_bytes()


def test_a_wiped_host_resumes_from_the_local_step_with_nothing_from_the_persistent_tier(saved):
    root, local_base = saved
    shutil.rmtree(local_base / "host1")  # a replaced VM
    hide_persistent_data(root)
    for r in lines(run("restore", root, local_base)):
        assert r["step"] == 3 and r["equal"] and r["position"] == 30, r
        assert r["draw"] == draw_after_seed(300 + r["host"])  # host 1's generators came back with its step
        assert any("restored step 3 from the local tier" in line for line in r["logs"]), r["logs"]
        assert not [e for e in r["events"] if e["tier"] == "persistent"], r["events"]
        fetched = [e for e in r["events"] if e["kind"] == "peer_fetched"]
        if r["host"] == 1:
            assert [(e["step"], e["details"]) for e in fetched] == [(3, {"source": 3, "repair": False})]
            assert fetched[0]["nbytes"] == sum(tree_bytes(local_base / "host3" / "peer_copies" / "1" / "3").values()) \
                - os.path.getsize(local_base / "host3" / "peer_copies" / "1" / "3" / "copy.json")
        else:
            assert not fetched
    copy = local_base / "host3" / "peer_copies" / "1" / "3"
    fetched_files = tree_bytes(local_base / "host1" / "3")
    assert fetched_files == {name: size for name, size in tree_bytes(copy).items() if name != "copy.json"}
    for name in fetched_files:
        assert (local_base / "host1" / "3" / name).read_bytes() == (copy / name).read_bytes()


def test_files_moved_in_many_rounds_two_in_flight_arrive_whole(tmp_path):
    """Pieces of 1 KiB, two per round: every copy and the fetch of a wiped host's step take many rounds, each
    started before the one before it has landed; the bytes are the writer's all the same."""
    root, local_base = tmp_path / "persistent", tmp_path / "local"
    for r in lines(run("save", root, local_base, piece_bytes=1024)):
        assert r["error"] is None and r["local"] == [2, 3], r
    writer = local_base / "host3" / "3"
    copy = local_base / "host1" / "peer_copies" / "3" / "3"
    assert max(tree_bytes(writer).values()) > 8 * 1024  # at least one file takes several rounds
    for name in tree_bytes(writer):
        assert (copy / name).read_bytes() == (writer / name).read_bytes()
    shutil.rmtree(local_base / "host3")
    hide_persistent_data(root)
    for r in lines(run("restore", root, local_base, piece_bytes=1024)):
        assert r["step"] == 3 and r["equal"], r
    for name in tree_bytes(writer):
        assert (writer / name).read_bytes() == (copy / name).read_bytes()


def test_two_wiped_hosts_holding_each_others_copies_fall_back_to_the_persistent_tier(saved):
    root, local_base = saved
    shutil.rmtree(local_base / "host0")
    shutil.rmtree(local_base / "host2")  # host 0's copies were on host 2, and host 2's on host 0
    for r in lines(run("restore", root, local_base)):
        resumed_step_2(r, "persistent")


def damage_largest_file(step_dir) -> str:
    files = sorted((p for p in (step_dir / "model").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(files[-1].read_bytes())
    data[len(data) // 2] ^= 0xFF
    files[-1].write_bytes(bytes(data))
    return str(files[-1].relative_to(step_dir))


def test_a_copy_damaged_where_it_is_held_is_refused_and_the_step_before_is_resumed(saved):
    """Host 1 is wiped and the copy of its step 3 on host 3 has a flipped byte: what arrives does not match the
    copy's CRC32Cs, nothing of it is kept, and the job resumes step 2 (its copy intact) from the local tier."""
    root, local_base = saved
    damaged = damage_largest_file(local_base / "host3" / "peer_copies" / "1" / "3")
    shutil.rmtree(local_base / "host1")
    results = lines(run("restore", root, local_base))
    for r in results:
        skipped = resumed_step_2(r, "local")
        assert len(skipped) == 1, r["warnings"]
        assert "step 3 arrived damaged" in skipped[0] and f"{damaged} from process 3" in skipped[0], skipped
    assert "3" not in os.listdir(local_base / "host1")  # nothing of what arrived was kept


def test_a_damaged_chunk_comes_from_a_peer(saved):
    root, local_base = saved
    damaged = damage_largest_file(local_base / "host0" / "3")
    hide_persistent_data(root)
    for r in lines(run("restore", root, local_base)):
        assert r["step"] == 3 and r["equal"] and r["position"] == 30, r
        assert r["draw"] == draw_after_seed(300 + r["host"])
        assert any("damaged on process [0]" in w and "replacing the damaged files" in w for w in r["warnings"]), r
        fetched = [e for e in r["events"] if e["kind"] == "peer_fetched"]
        if r["host"] == 0:  # the damaged file alone travelled
            assert [(e["step"], e["details"], e["nbytes"]) for e in fetched] == [
                (3, {"source": 2, "repair": True}, os.path.getsize(local_base / "host0" / "3" / damaged))]
        else:
            assert not fetched
    original = local_base / "host2" / "peer_copies" / "0" / "3" / damaged
    assert (local_base / "host0" / "3" / damaged).read_bytes() == original.read_bytes()


def test_a_process_killed_while_replicating_leaves_that_step_unreplicated(tmp_path):
    root, local_base = tmp_path / "persistent", tmp_path / "local"
    # Host 1 dies as it is about to commit its copy of host 3's step 3.
    results = run("save", root, local_base, "1", expect_ok=False)
    assert results[1]["returncode"] == -9 and not results[1]["lines"]
    for rank in (0, 2, 3):
        out = results[rank]["lines"][-1]
        assert "replicating step 3" in (out["error"] or out.get("close_error") or ""), out
        assert out["local"] == [2, 3]
    assert "3" not in os.listdir(local_base / "host1" / "peer_copies" / "3")  # never committed there
    shutil.rmtree(local_base / "host3")  # the host whose step 3 has no committed copy anywhere
    hide_persistent_data(root)
    for r in lines(run("restore", root, local_base)):
        assert r["step"] == 2 and r["equal"] and r["position"] == 20, r  # step 3 is not counted as replicated
        assert any("restored step 2 from the local tier" in line for line in r["logs"]), r["logs"]
        if r["host"] == 3:
            assert any("step 2 of the local tier came from process 1" in line for line in r["logs"]), r["logs"]
    assert not [n for n in os.listdir(local_base / "host1" / "peer_copies") if "partial" in n]
    assert not [n for n in os.listdir(local_base / "host1" / "peer_copies" / "3") if "partial" in n]


def test_a_disk_full_while_receiving_a_copy_is_raised_on_every_process(tmp_path):
    """Host 1's disk fills once its own step 3 is committed, as that step's replication starts: the copy of
    host 3's step 3 it receives cannot be written. Every process raises it (host 1 its own error, the others
    naming host 1 and the phase) instead of host 1 alone while the others carry on unaware; host 1 commits no
    part of that copy."""
    root, local_base = tmp_path / "persistent", tmp_path / "local"
    results = run("save", root, local_base, fsize="1:1024", fsize_from=3, expect_ok=False)
    for rank, r in enumerate(lines(results)):
        assert r["local"] == [2, 3], r
        error = r["error"] or ""
        assert "replicating step 3" in error, r
        if rank == 1:
            assert "could not write" in error and "received from process 3" in error and "File too large" in error
        else:
            assert "failed on process 1: StorageError: could not write" in error, error
    assert "3" not in os.listdir(local_base / "host1" / "peer_copies" / "3")
    assert not [n for n in os.listdir(local_base / "host1" / "peer_copies" / "3") if "partial" in n]


def test_processes_on_other_hosts_repair_from_the_copy_of_their_hosts_step(saved):
    root, local_base = saved
    damaged = damage_largest_file(local_base / "host0" / "3")
    hide_persistent_data(root)
    for r in lines(run("restore", root, local_base, hosts="1,0,3,2")):  # rank 1 on host 0, rank 3 on host 2
        assert r["step"] == 3 and r["equal"] and r["position"] == 30, r
        assert r["draw"] == draw_after_seed(300 + r["host"])  # the host's generators, whatever its index
        fetched = [e for e in r["events"] if e["kind"] == "peer_fetched"]
        # host 0's step (writer 0) is copied on host 2, now rank 3
        assert [e["details"] for e in fetched] == ([{"source": 3, "repair": True}] if r["host"] == 0 else [])
    assert (local_base / "host0" / "3" / damaged).read_bytes() == \
        (local_base / "host2" / "peer_copies" / "0" / "3" / damaged).read_bytes()


def test_data_parallel_replicas_copy_only_what_the_replica_lacks(tmp_path):
    root, local_base = tmp_path / "persistent", tmp_path / "local"
    saved = lines(run("save", root, local_base, layout="dp"))
    for r in saved:
        assert r["error"] is None and r["local"] == [2, 3], r
    for host in range(4):  # its peer (host + 2) is its data-parallel replica: the model is not copied
        copy = local_base / f"host{(host + 2) % 4}" / "peer_copies" / str(host) / "3"
        assert sorted(os.listdir(copy)) == ["_CHECKPOINT_METADATA", "commit_success.txt", "copy.json",
                                            "data_loader", "rng"]
        assert json.loads((copy / "copy.json").read_text())["shared"] == [["model", (host + 2) % 4]]
        sent = [e for e in saved[host]["events"] if e["kind"] == "peer_copies_committed"][-1]["details"]
        assert sent["sent_bytes"] == sum(tree_bytes(copy).values()) - (copy / "copy.json").stat().st_size

    damage_largest_file(local_base / "host1" / "3")  # a model file: the model comes whole from host 3's own step
    shutil.rmtree(local_base / "host0")  # its model comes from host 2's own step, the rest from its copy there
    hide_persistent_data(root)
    for r in lines(run("restore", root, local_base, layout="dp")):
        assert r["step"] == 3 and r["equal"] and r["position"] == 30, r
        assert r["draw"] == draw_after_seed(300 + r["host"])
        fetched = [(e["details"], e["nbytes"]) for e in r["events"] if e["kind"] == "peer_fetched"]
        if r["host"] == 0:
            assert fetched == [({"source": 2, "repair": False}, sum(tree_bytes(local_base / "host0" / "3").values()))]
        elif r["host"] == 1:  # (host 3's OCDBT files are named after it: the item travels whole)
            model = sum(tree_bytes(local_base / "host3" / "3" / "model").values())
            assert fetched == [({"source": 3, "repair": True}, model)]
        else:
            assert not fetched
    assert tree_bytes(local_base / "host0" / "3" / "model") == tree_bytes(local_base / "host2" / "3" / "model")
    for name in tree_bytes(local_base / "host3" / "3" / "model"):
        assert (local_base / "host1" / "3" / "model" / name).read_bytes() == \
            (local_base / "host3" / "3" / "model" / name).read_bytes()


def test_files_a_replica_cannot_read_from_its_own_step_are_refused_and_the_step_before_is_resumed(saved_dp):
    """DP: wiped host 0 gets its model from host 2's own step (no copy marker: the sender's CRC32Cs travel to it
    point to point). Host 2 cannot read the model files of step 3 as it sends them: host 0 refuses them, keeps
    nothing, and the job resumes step 2, whose model comes the same way."""
    root, local_base = saved_dp
    shutil.rmtree(local_base / "host0")
    hide_persistent_data(root)
    for r in lines(run("restore", root, local_base, layout="dp", unreadable=f"{os.sep}3{os.sep}model{os.sep}")):
        skipped = resumed_step_2(r)
        assert len(skipped) == 1 and "step 3 arrived damaged" in skipped[0], r["warnings"]
        assert "from process 2" in skipped[0] and "model/" in skipped[0], skipped
        fetched = [(e["step"], e["details"]) for e in r["events"] if e["kind"] == "peer_fetched"]
        assert fetched == ([(2, {"source": 2, "repair": False})] if r["host"] == 0 else []), fetched
    assert "3" not in os.listdir(local_base / "host0")  # nothing of what arrived was kept


def test_a_wiped_host_that_cannot_write_what_it_fetches_makes_the_job_fall_back(saved):
    """Host 1 is wiped and cannot write files past 1 KiB (a full disk): it receives each step all the same (its
    sender would wait for it otherwise), keeps none of it, and the job skips the local steps with warnings naming
    the file, the step and the sender, and resumes the persistent step."""
    root, local_base = saved
    shutil.rmtree(local_base / "host1")
    for r in lines(run("restore", root, local_base, fsize="1:1024")):
        skipped = resumed_step_2(r, "persistent")
        assert len(skipped) == 1 and "could not write" in skipped[0], r["warnings"]
        assert "of step 3 received from process 3" in skipped[0] and "File too large" in skipped[0], skipped
    assert "3" not in os.listdir(local_base / "host1")
    assert not [n for n in os.listdir(local_base / "host1" / "peer_copies") if "partial" in n]


def test_a_replica_that_cannot_list_its_step_makes_the_job_fall_back_at_once(saved_dp):
    """DP: wiped host 0's model is in host 2's own step, and host 2 cannot list that step any more. Host 2 tells
    host 0 why instead of the file list (it used to raise before sending anything, and host 0 waited for the
    list until the coordination timeout): host 0 keeps nothing, and the job skips the local steps with
    warnings naming host 2 and resumes the persistent step."""
    root, local_base = saved_dp
    shutil.rmtree(local_base / "host0")
    for r in lines(run("restore", root, local_base, layout="dp", unlistable=2)):
        skipped = resumed_step_2(r, "persistent")
        assert len(skipped) == 1 and "step 3 could not be fetched" in skipped[0], r["warnings"]
        assert "process 2 cannot list" in skipped[0] and "Permission denied" in skipped[0], skipped
    assert "3" not in os.listdir(local_base / "host0")


def test_incremental_steps_send_only_their_own_files_and_restore_bit_exact_with_their_base_from_peers(tmp_path):
    """Incremental steps on a replicated local tier (a frozen weight 32x the trained one): steps 2 and 3 reference
    step 1's chunks of it, so their replication sends only their own files (`peer_copies_committed`'s sent
    bytes), and the peers keep step 1's copy as their base. A wiped host fetches step 3 and its base from its
    peer and restores bit-exact, nothing read from the persistent tier; with the base's copy gone from the peer,
    the local steps that need it are skipped and the persistent step restored; a damaged chunk of the base is
    replaced from the base's copy."""
    root, local_base = tmp_path / "persistent", tmp_path / "local"
    sent: dict[int, list[int]] = {}
    for r in lines(run("save", root, local_base, incremental=True)):
        assert r["error"] is None and r["persistent"] == [2], r
        assert set(r["local"]) >= {2, 3}, r
        committed = [e for e in r["events"] if e["kind"] == "peer_copies_committed"]
        assert [e["step"] for e in committed] == [1, 2, 3]
        assert [e["details"]["holders"] for e in committed] == [{"0": [2], "1": [3], "2": [0], "3": [1]}] * 3, \
            (committed, r["logs"])
        for e in committed:
            sent.setdefault(e["step"], []).append(e["details"]["sent_bytes"])
        finished = {e["step"]: e["details"].get("bases") for e in r["events"]
                    if e["kind"] == "save_committed" and e["tier"] == "local"}
        assert finished == {1: None, 2: [1], 3: [1]}, finished
    frozen = 32 * 16 * 32 * 4  # the frozen shard's bytes on each host (FROZEN_ROWS x COLUMNS float32)
    for step in (2, 3):  # each process sends its w shard's new chunks and metadata, not its frozen shard again
        for full, incremental in zip(sent[1], sent[step]):
            assert incremental < full - frozen, (step, sent)
    for host in range(4):
        writer = (host + 2) % 4
        copies = local_base / f"host{host}" / "peer_copies" / str(writer)
        assert sorted(os.listdir(copies)) == ["1", "2", "3"]  # step 1 kept: steps 2 and 3 reference it
        for step in ("1", "2", "3"):
            copied = tree_bytes(copies / step)
            copied.pop("copy.json")
            assert copied == tree_bytes(local_base / f"host{writer}" / step)
        assert sum(tree_bytes(local_base / f"host{writer}" / "3").values()) == sent[3][writer]

    def restore_after(prepare) -> list[dict]:
        """Restore after `prepare` changed the saved tree, then put the tree back as saved (the same paths: a
        local step records its persistent root, and one of another root would not be this run's)."""
        backup = tmp_path / "backup"
        shutil.copytree(root, backup / "persistent", symlinks=True)
        shutil.copytree(local_base, backup / "local", symlinks=True)
        prepare()
        results = lines(run("restore", root, local_base, incremental=True))
        shutil.rmtree(root)
        shutil.rmtree(local_base)
        os.rename(backup / "persistent", root)
        os.rename(backup / "local", local_base)
        return results

    # The peer lost the base's copy: steps 2 and 3 cannot come whole to the wiped host, as if damaged.
    def lose_base() -> None:
        shutil.rmtree(local_base / "host1")
        shutil.rmtree(local_base / "host3" / "peer_copies" / "1" / "1")

    for r in restore_after(lose_base):
        assert r["step"] == 2 and r["equal"] and r["position"] == 20, r
        assert any("restored step 2 from the persistent tier" in line for line in r["logs"]), r["logs"]
        assert not [e for e in r["events"] if e["kind"] == "peer_fetched"], r["events"]

    # A damaged chunk of the base on host 0: only that file comes from the copy of step 1 on host 2.
    damaged: list[str] = []

    def damage_base() -> None:
        damaged.append(damage_largest_file(local_base / "host0" / "1"))
        hide_persistent_data(root)

    size = None
    for r in restore_after(damage_base):
        assert r["step"] == 3 and r["equal"] and r["position"] == 30, r
        assert any("damaged on process [0]" in w and "replacing the damaged files" in w for w in r["warnings"]), r
        repaired = [(e["step"], e["nbytes"], e["details"]) for e in r["events"] if e["kind"] == "peer_fetched"]
        if r["host"] == 0:
            size = os.path.getsize(local_base / "host0" / "1" / damaged[0])
            assert repaired == [(1, size, {"source": 2, "repair": True}), (3, 0, {"source": 2, "repair": True})]
        else:
            assert not repaired
    assert size is not None

    shutil.rmtree(local_base / "host1")  # a replaced VM
    hide_persistent_data(root)
    for r in lines(run("restore", root, local_base, incremental=True)):
        assert r["step"] == 3 and r["equal"] and r["position"] == 30, r
        assert any("restored step 3 from the local tier" in line for line in r["logs"]), r["logs"]
        assert not [e for e in r["events"] if e["tier"] == "persistent"], r["events"]
        fetched = [(e["step"], e["nbytes"], e["details"]) for e in r["events"] if e["kind"] == "peer_fetched"]
        if r["host"] == 1:
            copies = local_base / "host3" / "peer_copies" / "1"
            assert fetched == [(step, sum(tree_bytes(copies / str(step)).values())
                                - os.path.getsize(copies / str(step) / "copy.json"), {"source": 3, "repair": False})
                               for step in (1, 3)]
        else:
            assert not fetched
