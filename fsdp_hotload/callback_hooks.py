"""The optimizer step hooks behind ``HotloadCallback.attach()``.

Each optimizer gets one pre-step and one post-step hook of hotload's, shared by every callback attached to it
(a policy and its draft model on one optimizer), and each ``attach()`` call is an :class:`Attachment` with a live
switch of its own that ``detach()`` turns off for good. Why shared: torch runs an optimizer's post-step hooks in
turn and skips the rest once one raises, so the callback whose publish error is raised there would hide that step
from every callback attached after it, whose later snapshots would each carry the step before the trainer's. The
shared hook runs every attachment's part and raises the first error once all have run. Why a switch per attach:
the hooks cannot always be removed at ``detach()`` (removing one from another thread while ``optimizer.step()``
iterates over them raises there), and a part left behind must stay dead when the same callback attaches again.

Example::

    att = Attachment(cb, 2, fence=cb.fence, agree=..., publish=...)
    hook(att, (muon, adamw))        # both optimizers' shared hooks now run att's parts
    att.live = False; cb.fence(); release(att)
"""
from __future__ import annotations

import logging
import threading
import weakref
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

if TYPE_CHECKING:
    from .callback import HotloadCallback

log = logging.getLogger("fsdp_hotload")


class Attachment:
    """One ``attach()`` call: its callback's parts of the optimizers' step hooks, while ``live``.

    A snapshot is taken once every one of its ``count`` optimizers has stepped since the last one, so it never
    mixes two steps. ``fence`` runs before every step also once ``live`` is off, until :func:`release`: a detach
    on another thread than training must still make the trainer's next step wait for a copy reading the weights."""

    def __init__(self, owner: "HotloadCallback", count: int, *, fence: Callable[[], Any],
                 agree: Callable[[], Any], publish: Callable[[], Any]) -> None:
        self.owner = owner
        self.live = True
        self._count, self._fence, self._agree, self._publish = count, fence, agree, publish
        self._stepped: set[int] = set()
        self._optimizers: list[weakref.ref[torch.optim.Optimizer]] = []

    def pre(self, _index: int) -> None:
        self._fence()
        if self.live:
            self._agree()  # a no-op while one is pending (several optimizers)

    def post(self, index: int) -> None:
        if not self.live:
            return
        self._stepped.add(index)
        if len(self._stepped) == self._count:
            self._stepped.clear()
            self._publish()


class _SharedHooks:
    """hotload's two hooks on one optimizer and the attachments they run, in attach order. It holds no reference
    to its optimizer (the optimizer holds it, through the hooks), so a freed optimizer is collected at once."""

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self.parts: tuple[tuple[Attachment, int], ...] = ()  # replaced, never changed in place: read by steps
        self.registrar = threading.get_ident()
        self.stepper: int | None = None  # the thread that last stepped the optimizer
        self.handles = [opt.register_step_pre_hook(self._pre), opt.register_step_post_hook(self._post)]

    def _pre(self, *_: Any) -> None:
        self.stepper = threading.get_ident()
        try:
            self._each(Attachment.pre)
        finally:  # a dead part left by a detach on another thread has fenced here: from now on it can go
            if any(not att.live for att, _ in self.parts):
                with _LOCK:
                    self.parts = tuple(part for part in self.parts if part[0].live)

    def _post(self, *_: Any) -> None:
        self._each(Attachment.post)

    def _each(self, call: Callable[[Attachment, int], None]) -> None:
        """Every part runs, also after one raised: a callback must count every step the optimizer takes."""
        first: Exception | None = None
        for att, index in self.parts:
            try:
                call(att, index)
            except Exception as exc:  # noqa: BLE001 - raised below, once every attached callback has run
                if first is None:
                    first = exc
                else:  # only one error can leave optimizer.step(): the others are told here
                    log.error("hotload: another HotloadCallback attached to this optimizer failed at the same "
                              "step: %r", exc)
        if first is not None:
            raise first

    def removable(self) -> bool:
        """Whether this thread may remove the hooks: the thread that steps the optimizer (or, before any step, the
        one that registered them). From any other, removing one while optimizer.step() iterates over the hooks
        raises there ("OrderedDict mutated during iteration"); they stay instead, running nothing."""
        return threading.get_ident() == (self.stepper if self.stepper is not None else self.registrar)


_SHARED: "weakref.WeakKeyDictionary[torch.optim.Optimizer, _SharedHooks]" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()  # attach() and detach() may run on two threads (a watchdog's close())


def attached(opt: torch.optim.Optimizer) -> list["HotloadCallback"]:
    """The callbacks whose live attachments run on ``opt``'s steps, in attach order."""
    shared = _SHARED.get(opt)
    return [] if shared is None else [att.owner for att, _ in shared.parts if att.live]


def hook(att: Attachment, optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """Run ``att``'s parts at every step of each of ``optimizers`` (its index among them tells them apart)."""
    with _LOCK:
        for index, opt in enumerate(optimizers):
            shared = _SHARED.get(opt)
            if shared is None:
                shared = _SHARED[opt] = _SharedHooks(opt)
            shared.parts = (*shared.parts, (att, index))
            att._optimizers.append(weakref.ref(opt))


def release(att: Attachment) -> None:
    """Take ``att`` (turned off already) off its optimizers; an optimizer's hooks go with their last attachment
    where this thread may remove them (see :meth:`_SharedHooks.removable`). From another thread ``att`` stays until
    the trainer's next step has fenced in its pre-step hook (a copy may start after this returns), then goes."""
    with _LOCK:
        for ref in att._optimizers:
            opt = ref()
            shared = None if opt is None else _SHARED.get(opt)
            if shared is None:
                continue
            if not shared.removable():  # its pre part must still fence the trainer's next step (see _pre)
                continue
            shared.parts = tuple(part for part in shared.parts if part[0] is not att)
            if not shared.parts:
                pre, post = shared.handles
                post.remove()
                pre.remove()
                del _SHARED[opt]
        att._optimizers = []


#: Callbacks one of whose attached optimizers was freed, and attach() has not run since (see _optimizer_gone).
_ORPHANED: "weakref.WeakSet[HotloadCallback]" = weakref.WeakSet()
_orphan_hook: list[Any] = []  # the one global step hook that reads _ORPHANED, registered at the first need


def watch(cb: "HotloadCallback", opt: torch.optim.Optimizer) -> weakref.finalize:
    """Tell, at a later step, that ``opt`` was freed while ``cb`` was attached to it (see _optimizer_gone)."""
    gone = weakref.finalize(opt, _optimizer_gone, weakref.ref(cb), type(opt).__name__)
    gone.atexit = False  # at the interpreter's exit nothing stopped publishing that would have gone on
    return gone


def _optimizer_gone(ref: "weakref.ref[HotloadCallback]", kind: str) -> None:
    """An attached optimizer was freed while its callback's hooks were on. Why say it: a training loop that
    re-creates its optimizer (a schedule restart, a resumed run) without attaching the new one stops publishing
    with no error at all, and the fleet serves a policy that grows older every step. Said at the next step any
    optimizer takes before ``attach()`` runs again, not at once: ``opt = AdamW(...); hot.attach(opt)`` frees the
    old one before it attaches the new one, and is right."""
    cb = ref()
    if cb is None or not cb._hooks_on or cb.engine.closed:
        return
    cb._freed_optimizer = kind
    _ORPHANED.add(cb)
    if not _orphan_hook:  # one for the process, never removed: a hook may not leave the dict its step iterates
        _orphan_hook.append(register_optimizer_step_post_hook(_stepped_unattached))


def _stepped_unattached(*_: Any) -> None:
    """An optimizer stepped: warn for each callback whose attached optimizer was freed and attach() not run since."""
    for cb in list(_ORPHANED):
        _ORPHANED.discard(cb)
        if cb._hooks_on and not cb.engine.closed:
            log.warning("hotload: the %s optimizer this HotloadCallback was attached to was freed, and an optimizer "
                        "has stepped since without attach(): nothing is published from its steps; call attach() "
                        "with the new optimizer(s)", cb._freed_optimizer)
