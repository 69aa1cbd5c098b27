"""The staging engine's device ledger, as DeviceMemoryProbe and users read it: levels add
up, every open probe is told each new level, and a closed probe is told nothing more."""

from __future__ import annotations

from wrapped_optim.testing.probe import DeviceMemoryProbe, device_ledger


def test_levels_add_up_and_go_back_down() -> None:
    start = device_ledger.live_bytes
    device_ledger.allocate(64)
    device_ledger.allocate(32)
    assert device_ledger.live_bytes == start + 96
    device_ledger.release(64)
    assert device_ledger.live_bytes == start + 32
    device_ledger.release(32)
    assert device_ledger.live_bytes == start


def test_every_open_probe_sees_each_level_and_a_closed_one_sees_none() -> None:
    with DeviceMemoryProbe() as outer:
        device_ledger.allocate(10)
        with DeviceMemoryProbe() as inner:
            device_ledger.allocate(30)
            device_ledger.release(30)
        device_ledger.release(10)
        device_ledger.allocate(5)
        device_ledger.release(5)
    device_ledger.allocate(1000)  # after both closed: counted by neither
    device_ledger.release(1000)
    assert (outer.peak_extra_bytes, inner.peak_extra_bytes) == (40, 30)


def test_a_new_ledger_starts_empty_and_serialises_writers() -> None:
    """The process-wide ledger is built at import; one built the same way starts at zero,
    tells its observers each level, and keeps an exact count under concurrent writers."""
    import threading

    ledger = type(device_ledger)()
    levels: list[int] = []
    assert ledger.attach(levels.append) == 0 and ledger.live_bytes == 0

    def writer() -> None:
        for _ in range(200):
            ledger.allocate(1)
            ledger.release(1)

    threads = [threading.Thread(target=writer) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    ledger.detach(levels.append)
    assert ledger.live_bytes == 0 and len(levels) == 800 and max(levels) <= 4
