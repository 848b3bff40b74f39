"""torchrun for ``hotload demo``, passing on only its exit status where the demo's ranks have already said why.

torchrun ends a Ctrl-C with a ``SignalException`` traceback and a rank that failed with a ``ChildFailedError``
banner: about 25 and 40 lines below the ranks' own one-line messages, which the user then has to dig out. Here a
Ctrl-C exits 130 and a failed rank exits 1, with nothing more printed; the demo's launcher says what happened.

Example::

    python -m fsdp_hotload.demo_torchrun --standalone --nproc-per-node=2 -m fsdp_hotload.demo --job ...
"""
from __future__ import annotations

import logging
import signal
import sys

#: torchrun's own exit status for an interrupt: what a shell reports for a command stopped by SIGINT.
EXIT_INTERRUPTED = 130


def main() -> int:
    try:
        return _main()
    except KeyboardInterrupt:  # a Ctrl-C before torchrun took over its signals (importing torch takes seconds)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        return EXIT_INTERRUPTED


def _main() -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    # Its warnings ("Sending process N closing signal SIGINT") narrate a Ctrl-C the user just typed; its errors
    # still show. Only this process's: each rank is an interpreter of its own.
    logging.disable(logging.WARNING)
    try:
        torchrun()
    except SignalException:
        # the ranks are stopped; a second Ctrl-C (the launcher passes its own on too) must not cut the exit short
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        return EXIT_INTERRUPTED
    except ChildFailedError:  # each failed rank printed its error; the banner would only repeat "failed"
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
