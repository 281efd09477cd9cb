"""The Worker's liveness heartbeat and its probe, on real files."""

from __future__ import annotations

from pathlib import Path

import pytest
from qinglong_worker.clock import boot_clock_seconds
from qinglong_worker.heartbeat import (
    EXIT_ALIVE,
    EXIT_STALE,
    INBOX_VARIABLE,
    Heartbeat,
    OtherBoot,
    heartbeat_age,
    heartbeat_path,
    probe_main,
)
from qinglong_worker.settings import _variable as variable_of


def _probe(inbox: Path, *extra: str) -> int:
    return probe_main(["--inbox", str(inbox), *extra])


def test_a_beat_is_read_back_as_young_and_ages_with_the_boot_clock(tmp_path: Path) -> None:
    path = heartbeat_path(tmp_path / "inbox.db")
    beat = Heartbeat(path)
    beat.beat()
    assert -0.001 <= heartbeat_age(path) < 60  # written to the millisecond, rounded
    later = boot_clock_seconds() + 500
    assert heartbeat_age(path, now=later) > 499
    assert path.stat().st_mode & 0o777 == 0o600
    beat.close()


def test_each_beat_overwrites_the_last_whole(tmp_path: Path) -> None:
    path = tmp_path / "heartbeat"
    path.write_bytes(b"x" * 300)  # longer than a beat: left by something else
    beat = Heartbeat(path)
    beat.beat()
    first = path.read_bytes()
    beat.beat()
    second = path.read_bytes()
    assert len(first) == len(second)
    assert second.count(b"\n") == 1
    assert float(second.split()[1]) >= float(first.split()[1])
    assert heartbeat_age(path) < 60
    beat.close()


def test_the_probe_passes_on_a_fresh_beat_and_fails_on_an_old_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    inbox = tmp_path / "inbox.db"
    Heartbeat(heartbeat_path(inbox)).beat()
    assert _probe(inbox) == EXIT_ALIVE
    assert capsys.readouterr().out.startswith("alive")
    # A beat written 200 s ago on this boot's clock: stale for 120 s, alive for 300 s.
    boot, _ = heartbeat_path(inbox).read_text().split()
    heartbeat_path(inbox).write_text(f"{boot} {boot_clock_seconds() - 200:20.3f}\n")
    assert _probe(inbox) == EXIT_STALE
    assert capsys.readouterr().out.startswith("stale: the Worker last ticked 200 s ago")
    assert _probe(inbox, "--stale-seconds", "300") == EXIT_ALIVE


def test_a_beat_of_an_earlier_boot_is_stale_whatever_its_number(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    inbox = tmp_path / "inbox.db"
    # A later number than now: after a reboot the boot clock starts again near zero.
    other = "00000000-0000-4000-8000-000000000000"
    heartbeat_path(inbox).write_text(f"{other} {boot_clock_seconds() + 10:20.3f}\n")
    with pytest.raises(OtherBoot):
        heartbeat_age(heartbeat_path(inbox))
    assert _probe(inbox) == EXIT_STALE
    assert "earlier boot" in capsys.readouterr().out


@pytest.mark.parametrize("content", [b"", b"garbage\n", b"\xff\xfe 12\n", b"a b c\n"])
def test_a_missing_or_unreadable_heartbeat_fails_the_probe(
    tmp_path: Path, content: bytes, capsys: pytest.CaptureFixture[str]
) -> None:
    inbox = tmp_path / "inbox.db"
    assert _probe(inbox) == EXIT_STALE
    assert capsys.readouterr().out.startswith("no heartbeat")
    heartbeat_path(inbox).write_bytes(content)
    assert _probe(inbox) == EXIT_STALE
    assert capsys.readouterr().out.startswith("no heartbeat")


def test_a_beat_that_cannot_be_written_is_retried_at_the_next(tmp_path: Path) -> None:
    directory = tmp_path / "gone"
    beat = Heartbeat(directory / "heartbeat")
    beat.beat()  # the directory does not exist: logged, nothing raised
    assert not (directory / "heartbeat").exists()
    directory.mkdir()
    beat.beat()
    assert heartbeat_age(directory / "heartbeat") < 60
    beat.close()


def test_the_probe_takes_the_inbox_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    inbox = tmp_path / "inbox.db"
    Heartbeat(heartbeat_path(inbox)).beat()
    # The daemon's own variable: one setting names the inbox for both.
    assert variable_of("inbox") == INBOX_VARIABLE
    monkeypatch.setenv(INBOX_VARIABLE, str(inbox))
    assert probe_main([]) == EXIT_ALIVE
    monkeypatch.delenv(INBOX_VARIABLE)
    with pytest.raises(SystemExit) as usage:
        probe_main([])
    assert usage.value.code == 2
    assert "probe needs --inbox" in capsys.readouterr().err


def test_a_heartbeat_removed_while_the_daemon_runs_is_written_again(tmp_path: Path) -> None:
    inbox = tmp_path / "inbox.db"
    beat = Heartbeat(heartbeat_path(inbox))
    beat.beat()
    heartbeat_path(inbox).unlink()  # a tidy-up of the volume, say
    beat.beat()
    assert _probe(inbox) == EXIT_ALIVE
    beat.close()
