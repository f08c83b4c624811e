"""Reservations read from another thread (issue 24 L7): a rank's metrics scrape reads the
reservation book's num_blocks while the engine thread reserves and releases; the read must never
raise "dictionary changed size during iteration"."""

import sys
import threading

from engine.handoff import Reservation, Reservations


def test_num_blocks_can_be_read_while_the_book_changes():
    book = Reservations(None, [], None)
    for i in range(20_000):  # a big book: each read iterates long enough to be interrupted
        book._book[f"r{i}"] = Reservation(f"r{i}", [i], 0, 0.0)
    stop, errors, reads = threading.Event(), [], [0]

    def scrape() -> None:
        while not stop.is_set():
            try:
                assert book.num_blocks >= 20_000
                reads[0] += 1
            except BaseException as e:  # the race would surface here
                errors.append(e)
                return

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as CPython allows
    try:
        reader = threading.Thread(target=scrape)
        reader.start()
        for i in range(20_000, 60_000):  # the engine thread's inserts and removals
            book._book[f"r{i}"] = Reservation(f"r{i}", [i], 0, 0.0)
            if i % 2:
                del book._book[f"r{i}"]
        stop.set()
        reader.join(30)
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors
    assert reads[0] > 0 and len(book) == 20_000 + 20_000
