"""What a science batch starts and what it carries (benchmarks/science_fit.py): the tree a device call
carries is measured as git lists it (ignored files left out, untracked ones counted), the room left
for a cut run's state follows, and a run is started only when it finishes, its state can travel, or no
batch has timed its variant yet."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import science_fit as fit  # noqa: E402


@pytest.fixture
def repo(tmp_path):
    """A git tree: 1,000 bytes tracked, 300 untracked, 5,000 ignored, a carried folder of 2 x 700 bytes."""
    r = tmp_path / "r"
    r.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=r, check=True)
    (r / ".gitignore").write_text("big/\n.whl/\n")  # 11 bytes, tracked
    (r / "a.txt").write_bytes(b"a" * 989)
    subprocess.run(["git", "add", ".gitignore", "a.txt"], cwd=r, check=True)
    (r / "new.txt").write_bytes(b"n" * 300)
    (r / "big").mkdir()
    (r / "big" / "x.bin").write_bytes(b"x" * 5000)
    (r / ".whl").mkdir()
    for i in range(2):
        (r / ".whl" / f"{i}.whl").write_bytes(b"w" * 700)
    return r


def test_the_tree_counts_tracked_and_untracked_files_but_not_ignored_ones(repo):
    assert fit.tree_bytes(repo) == 11 + 989 + 300
    (repo / "a.txt").unlink()  # deleted, still in the index: nothing travels
    assert fit.tree_bytes(repo) == 11 + 300


def test_the_room_is_the_call_less_the_tree_the_carried_paths_and_the_margin(repo):
    room = fit.carry_room(repo, [".whl", "big"], keep=["big"])
    assert room == pytest.approx(fit.CARRY_MIB - fit.MARGIN_MIB - (1300 + 1400) / fit.MIB, abs=1e-12)
    assert fit.carry_room(repo, [".whl", "big"]) == pytest.approx(room - 5000 / fit.MIB, abs=1e-12)
    assert fit.carry_room(repo, ["absent"]) == pytest.approx(fit.CARRY_MIB - fit.MARGIN_MIB - 1300 / fit.MIB, abs=1e-12)


def test_the_state_of_the_at_scale_window_cannot_travel_beside_this_tree():
    """The shipped experiment's window runs (4,041,768 parameters) have a state of 46.3 MiB: more than a
    call has room for beside a tree of over 15.7 MiB, which this one is."""
    assert fit.state_mib(4_041_768) == pytest.approx(12 * 4_041_768 / 2**20)
    assert fit.state_mib(4_041_768) > fit.CARRY_MIB - fit.MARGIN_MIB - fit.tree_bytes(ROOT) / fit.MIB


def test_speeds_are_each_variants_median_over_the_batches():
    batches = [{"runs": [{"run": "softmax/seed0", "tokens_per_s": 100}, {"run": "window/seed0", "tokens_per_s": None}]},
               {"runs": [{"run": "softmax/seed1", "tokens_per_s": 300}, {"run": "softmax/seed2", "tokens_per_s": 200}]},
               {"runs": None}]
    assert fit.measured_speeds(batches) == {"softmax": 200.0}


SPEEDS = {"softmax": 1000.0, "window": 100.0}


@pytest.mark.parametrize("name,tokens,state,left,room,start,seconds,words", [
    ("softmax/seed0", 100_000, 50.0, 200.0, 10.0, True, 195.0, "finishes"),           # 60 + 100 + 35
    ("softmax/seed0", 100_000, 50.0, 194.0, 10.0, False, 195.0, "cannot travel"),     # one second short
    ("window/seed0", 100_000, 5.0, 200.0, 10.0, True, 1095.0, "cut and carried"),
    ("window/seed0", 100_000, 10.0, 200.0, 10.0, True, 1095.0, "cut and carried"),    # exactly the room
    ("window/seed0", 100_000, 50.0, 200.0, None, True, 1095.0, "cut and carried"),    # no room known
    ("kl-window/seed0", 100_000, 50.0, 200.0, 10.0, True, None, "this one measures it"),
], ids=["finishes", "short", "carried", "room-exact", "no-room", "untimed"])
def test_a_run_starts_when_it_finishes_carries_or_is_untimed(name, tokens, state, left, room, start, seconds, words):
    d = fit.decide(fit.Candidate(name, tokens, state), left, room, SPEEDS)
    assert (d.start, d.name) == (start, name)
    assert d.seconds == (None if seconds is None else pytest.approx(seconds))
    assert words in d.why


def test_the_plan_spends_each_started_runs_seconds_before_the_next():
    runs = [fit.Candidate("softmax/seed0", 100_000, 50.0), fit.Candidate("window/seed0", 100_000, 50.0),
            fit.Candidate("softmax/seed1", 100_000, 50.0), fit.Candidate("softmax/seed2", 100_000, 50.0)]
    got = fit.plan(runs, 400.0, 10.0, SPEEDS)
    # 195 s for the first leaves 205: the window (1,095 s, no room) is passed over, the next softmax fits
    # (195 s), and the 10 s left take no more
    assert [d.start for d in got] == [True, False, True, False]
    untimed = fit.plan([fit.Candidate("kl-window/seed0", 1, 50.0), runs[0]], 400.0, 10.0, SPEEDS)
    assert [d.start for d in untimed] == [True, False]  # an untimed run is taken to use the batch
