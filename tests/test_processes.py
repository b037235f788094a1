"""processes.SignalStop: how the commands (demo, loadtest, serve-demo, collector) route SIGINT / SIGTERM to a stop."""

from __future__ import annotations

import signal
import threading

from zoomer_serve.processes import SignalStop


def test_a_signal_sets_the_event_names_itself_and_the_old_handlers_come_back(capsys):
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    with SignalStop("zoomer-serve demo") as stopping:
        assert not stopping.stopped and stopping.signal_name == "" and stopping.exit_code == 0
        signal.raise_signal(signal.SIGTERM)
        assert stopping.event.wait(5)
        signal.raise_signal(signal.SIGINT)  # while stopping: noted, the first signal stays the one
    assert {sig: signal.getsignal(sig) for sig in before} == before
    assert (stopping.signum, stopping.signal_name, stopping.exit_code) == (signal.SIGTERM, "SIGTERM", 143)
    err = capsys.readouterr().err
    assert "zoomer-serve demo: SIGTERM received: stopping the load, then the server" in err
    assert "zoomer-serve demo: SIGINT received again: already stopping, in order" in err


def test_a_quiet_stop_sets_the_event_it_was_given_and_says_nothing(capsys):
    stop = threading.Event()
    with SignalStop("zoomer-serve collector", event=stop, announce=False) as stopping:
        signal.raise_signal(signal.SIGINT)
        assert stop.wait(5)
    assert stopping.event is stop
    assert (stopping.signal_name, stopping.exit_code) == ("SIGINT", 130)
    assert capsys.readouterr().err == ""


def test_off_the_main_thread_nothing_is_routed_and_the_event_still_stops():
    """Python installs signal handlers on the main thread only (``collector.run`` is also called from threads):
    entering elsewhere must neither raise nor touch the handlers."""
    before = signal.getsignal(signal.SIGTERM)
    seen: list[object] = []

    def enter() -> None:
        with SignalStop("zoomer-serve collector", announce=False) as stopping:
            seen.append(signal.getsignal(signal.SIGTERM))
            stopping.event.set()
            seen.append(stopping.stopped)

    worker = threading.Thread(target=enter)
    worker.start()
    worker.join(10)
    assert seen == [before, True]
    assert signal.getsignal(signal.SIGTERM) == before
