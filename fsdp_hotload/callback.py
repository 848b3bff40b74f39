"""The FSDP callback: two lines in a training script keep the rollout fleet on the newest policy.

``HotloadCallback(model, config)`` finds the part of every HF tensor this rank holds (FSDP2 ``fully_shard``,
FSDP1 with or without ``use_orig_params``, or a plain module), and ``step(step)`` after ``optimizer.step()``
copies those shards into a staging buffer and returns; diffing, encoding, uploading and signalling run in a
background thread per rank. Side gloo groups carry the publisher's traffic, never the training group.

Example::

    cfg = HotloadConfig.from_env()                      # or HotloadConfig(bucket_url=..., ...)
    with HotloadCallback(model, cfg) as hot:
        for step, batch in enumerate(loader, start=resumed_step):   # a global step: it names the snapshot
            loss = model(batch).loss; loss.backward(); optimizer.step(); optimizer.zero_grad()
            hot.step(step)
    # or: hot.attach(optimizer, first_step=resumed_step) to publish from the optimizer's step hooks
"""
from __future__ import annotations

import contextlib
import functools
import logging
import sys
import weakref
from typing import Any, Callable

import torch

from .callback_hooks import _ORPHANED, Attachment, attached, hook, release, watch
from .config import HotloadConfig
from .dtype_policy import DtypePolicy
from .engine.comm import Comm, GlooComm, LocalComm
from .engine.copies import storage_ptr
from .engine.metrics import PublishMetrics
from .engine.publisher import Publisher
from .fsdp import (OwnershipError, fsdp1_untied_note, full_tensor_specs, local_chunks, model_parallel_note,
                   source_dtypes, storage_fingerprint, tensor_paths)
from .fsdp_recheck import RecheckReplicas
from .fsdp_verify import agree_on_chunks, plain_samples, replica_samples
from .hf_config import base_tensors, hf_tie_word_embeddings, names_note, narrowed_note, shapes_note
from .hf_names import checkpoint_names, transformers_saved_shapes
from .layout import TensorSpec
from .masking import mask_url
from .naming import Split, adapter_note
from .storage_paths import root_key

log = logging.getLogger("fsdp_hotload")
def _clash(a: HotloadConfig, b: HotloadConfig) -> str | None:
    """Why two callbacks must not both publish every step (the same bucket, whose retention would delete the
    other's snapshots, or a deployment both signal), or None: two buckets and two fleets (a policy and its draft
    model, one model in two regions) publish side by side from one optimizer."""
    if root_key(a.bucket_url, a.storage_options) == root_key(b.bucket_url, b.storage_options):
        return f"publishing to {mask_url(b.bucket_url)}"
    if a.hotload_api_url is not None and (a.hotload_api_url, a.account_id) == (b.hotload_api_url, b.account_id):
        shared = sorted(set(a.deployments) & set(b.deployments))
        if shared:
            return f"signalling deployment {shared[0]}"
    return None


def _what_changed(old_specs: list[Any], specs: list[Any], old_layout: list[Any], layout: list[Any]) -> str:
    """The first change between two walks of the model, for the error that stops publishing."""
    before = {n: (tuple(sh), d) for n, sh, d in old_specs}
    now = {n: (tuple(sh), d) for n, sh, d in specs}
    for name in before:
        if name not in now:
            return f"tensor {name!r} is gone"
        if now[name] != before[name]:
            (shape0, d0), (shape1, d1) = before[name], now[name]
            cast = (" (FSDP1's MixedPrecision casts buffers at the first forward: create the callback after it)"
                    if shape0 == shape1 else "")
            return f"tensor {name!r} was {d0} {list(shape0)}, is {d1} {list(shape1)}{cast}"
    for name in now:
        if name not in before:
            return f"tensor {name!r} is new"
    for (n0, box0), (n1, box1) in zip(old_layout, layout):
        if (n0, box0) != (n1, box1):
            return f"this rank's part of {n0!r} ({box0.to_json()}) is now of {n1!r} ({box1.to_json()})"
    return f"this rank held {len(old_layout)} parts, now {len(layout)}"


def _destroy_dropped(comms: list[Comm], stop_engine: Callable[[], Any]) -> None:
    """The side groups of a callback whose engine was collected without close() (or after an abandoned one),
    destroyed once the engine's own finalizer (``stop_engine``, which runs at most once) has ended its threads.
    Why it is called here: finalizers of one object run newest first, so this one, registered after the engine's,
    would otherwise destroy the groups before the engine's threads were told to stop."""
    stop_engine()
    while comms:
        with contextlib.suppress(Exception):  # nobody is left to be told
            comms.pop().close()


#: From this many chunks on a rank, rank 0 suggests ``gc.freeze()`` at start (README: Many tensors).
MANY_CHUNKS = 20_000


class HotloadCallback:
    """Publishes a (possibly sharded) model's weights every ``config.publish_every`` steps.

    Example::

        with HotloadCallback(model, HotloadConfig.from_env()) as hot:   # FSDP2, FSDP1 or a plain module
            hot.attach(optimizer, first_step=resumed_step)              # or hot.step(step) after optimizer.step()
            train()

    Names: wrapper segments are stripped; ``split`` (e.g. :func:`~fsdp_hotload.naming.split_fused_experts` for a
    transformers 5 MoE model) divides a tensor into the checkpoint's tensors, ``rename`` then maps each name
    (None drops it; ``(name, position)`` joins the tensors given that name along dim 0, in position order), and
    ``tie_word_embeddings`` (default: the HF config's) leaves out a tied ``lm_head``. With neither ``split`` nor
    ``rename`` given, a transformers model whose ``save_pretrained`` writes other names (a MoE model's experts,
    renamed modules, joined projections) gets both from transformers' own conversion mapping where it can be
    followed in place (``hf_names``, :mod:`fsdp_hotload.hf_names`).
    """

    def __init__(self, model: torch.nn.Module, config: HotloadConfig, *,
                 rename: Callable[[str], str | None] | None = None, tie_word_embeddings: bool | None = None,
                 include_buffers: bool = True, split: Split | None = None, hf_names: bool = True,
                 **engine_kwargs: Any) -> None:
        import torch.distributed as dist

        if not isinstance(model, torch.nn.Module):  # checked before the collective side groups are made
            chunks = " (Megatron's get_model returns its model chunks as a list: publish a Hugging Face state dict " \
                     "gathered from them with TensorPublisher)" if isinstance(model, (list, tuple)) else ""
            raise TypeError(f"HotloadCallback takes a torch.nn.Module, got {type(model).__name__}{chunks}")
        self.model = model
        self.config = config = config.checked()
        comm: Comm
        ctrl: Comm
        # The side groups first: creating them is collective, so a rank that failed before it would leave the
        # others waiting there. Whatever fails on one rank after it fails every rank, in agree_on_chunks.
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            timeout = config.side_group_timeout_s  # background thread / main thread:
            comm, ctrl = GlooComm.create(timeout), GlooComm.create(timeout)
        else:
            comm = ctrl = LocalComm()
        self._comms = [comm, ctrl]
        try:
            walked: list[Any] = []
            held: dict[str, torch.Tensor] = {}  # plain parameters, on every rank
            self._specs: list[Any] = []
            problem: Exception | None = None
            samples: list[int | None] | None = None  # replica_samples: told apart from partitions
            plain: dict[str, int] | None = None  # plain_samples: the same, for tensors rank 0 alone publishes
            try:
                several = isinstance(comm, GlooComm)  # several ranks: maybe partitions, whatever the names
                note = model_parallel_note(model, several_ranks=several)
                if note and (several or (rename is None and split is None)):
                    raise ValueError(note)
                self._plan_names(split, rename, tie_word_embeddings, include_buffers, hf_names)
                self._fingerprint = storage_fingerprint(model)
                walked = local_chunks(model, **self._chunk_kwargs, plain=held)
                self._specs = full_tensor_specs(model, **self._chunk_kwargs)
                if not self._specs:  # the same on every rank
                    raise ValueError("the model has no tensor to publish (no parameters or buffers, or the rename "
                                     "function returned None for all of them)")
                buffers = set(self._buffer_chunks(walked))
                if isinstance(comm, GlooComm):
                    samples = replica_samples(walked, skip=buffers)
                    plain = plain_samples(held, whole=True)  # whole: rows a sample misses, once
            except Exception as exc:  # noqa: BLE001 - raised by agree_on_chunks, on every rank
                problem = exc
            self.walks = 1  # model walks for chunk views (the first here; again only when storage changed)
            agreed = agree_on_chunks(walked, self._specs, ctrl, problem, samples, plain)
            self._kept = agreed.kept
            # A group of its own, only where there is something to compare again (the same answer on every rank).
            again = GlooComm.create(config.side_group_timeout_s) if agreed.recheck else None
            if again is not None:
                self._comms.append(again)
            # then once per full snapshot's span of calls, for copies that start to drift later
            self._recheck = RecheckReplicas(agreed, walked, held, self._fingerprint, again,
                                            every=config.full_every * config.publish_every)
            chunks = [walked[i] for i in self._kept]
            self._buffer_idx = [j for j, i in enumerate(self._kept) if i in buffers]
            specs = [TensorSpec(n, tuple(s), d) for n, s, d in self._specs]
            self.engine = Publisher(chunks, specs, config, comm=comm, ctrl=ctrl, owner="HotloadCallback",
                                    **engine_kwargs)
        except BaseException:
            self._close_comms()
            raise
        # Dropped without close(), the engine's finalizer ends its threads; this one then destroys the side groups
        # (gloo's threads and a socket per peer each), which torch's registry would keep for the process's life.
        # Not before: nothing can be in their collectives once the engine, which a running job holds, is gone.
        weakref.finalize(self.engine, _destroy_dropped, self._comms, self.engine.drop_finalizer).atexit = False
        if self.engine.rank == 0 and len(chunks) >= MANY_CHUNKS:
            log.info("hotload: %d chunks on this rank; the interpreter's full garbage collections over that many "
                     "objects hold the GIL for a while on the publisher's thread: calling gc.freeze() once the model, "
                     "the optimizer and this callback are built keeps them short (README: Many tensors)", len(chunks))
        if self.engine.rank == 0:
            try:
                self._warn_about_model()
            except Exception as exc:  # noqa: BLE001 - advice only: it must not stop rank 0 alone, the others running
                log.warning("hotload: the start-up checks of the model's names, dtypes and shapes failed: %r", exc)
        self._layout = [(c.name, c.box) for c in walked]
        self._views = [c.source for c in chunks]
        self._step = 0
        self._attachment: Attachment | None = None  # the newest attach()'s, until detach() (callback_hooks)
        self._hooks_on = False  # whether attach()'s post-hooks publish (see detach)
        self._watches: list[weakref.finalize] = []  # one per attached optimizer: see callback_hooks.watch
        self._freed_optimizer = ""  # the kind of an attached optimizer that was freed (see callback_hooks)

    def _plan_names(self, split: Split | None, rename: Callable[[str], str | None] | None,
                    tie_word_embeddings: bool | None, include_buffers: bool, hf_names: bool) -> None:
        """The chunk arguments: the split and rename to publish under (the caller's, else hf_names' plan)."""
        config, model = self.config, self.model
        if tie_word_embeddings is None:
            tie_word_embeddings = hf_tie_word_embeddings(config.hf_config_dir)
        # The base checkpoint's shapes (headers only; None without weights there), read at most once, when needed.
        self._base_tensors = functools.cache(lambda: base_tensors(config.hf_config_dir))  # shapes, dtypes
        self._base = lambda: self._base_tensors()[0]
        # A transformers model is published under its checkpoint's names where transformers says how (the same
        # answer on every rank); a split or rename of the caller's own is taken as it is.
        self.names_plan = None if not hf_names or split is not None or rename is not None else checkpoint_names(
            model, lambda: full_tensor_specs(model, tie_word_embeddings=tie_word_embeddings,
                                             include_buffers=include_buffers), self._base)
        if self.names_plan is not None:
            split, rename = self.names_plan.split, self.names_plan.rename
        self._chunk_kwargs: dict[str, Any] = dict(
            snapshot_dtype=config.snapshot_dtype, dtype_overrides=config.dtype_overrides, rename=rename,
            tie_word_embeddings=tie_word_embeddings, include_buffers=include_buffers, split=split)

    def step(self, step: int | None = None) -> bool:
        """Call right after ``optimizer.step()``; returns True if a snapshot was started at this step.

        The weights may change once this returns: on CPU the copy of the local shard is done; on GPU it is queued
        on a side stream that the training stream waits for, so the next optimizer step cannot overtake it
        (with :meth:`attach`, a CPU copy can instead overlap the next forward and backward)."""
        return self._publish(step, background_copy=False)

    def _publish(self, step: int | None, background_copy: bool) -> bool:
        # Checked before it counts: a float is refused, not truncated, and a refused step leaves the count where
        # it was, so the optimizer hooks of attach() go on from the last step taken.
        if self.engine.closed:  # before the count moves, in attach()'s words
            raise RuntimeError("HotloadCallback is closed: create a new one to publish again")
        # a step given while attach()'s hooks publish is refused with advice about using both, not about epochs
        step = self.engine.checked_step(self._step if step is None else step,
                                        attached=step is not None and self._hooks_on)
        self._step = step + 1
        if self._recheck.due():  # every rank, at the same call
            self._recheck_replicas(step)
        # views are built only on steps that publish
        # only a host copy runs beside the next forward; a device copy is ordered before it on the device
        overlaps = background_copy and not self.engine.stager.cuda
        sources = self._background_sources if overlaps else self._sources
        return self.engine.publish(step, sources, background_copy=background_copy)

    def _recheck_replicas(self, step: int) -> None:
        """Compare the copies of a box again (:class:`~fsdp_hotload.fsdp_recheck.RecheckReplicas`); where they
        drifted apart, publishing stops on every rank at this step, before this step is published."""
        why = self._recheck.run(self.model, self._chunk_kwargs, step)
        if why is None:
            return
        error = OwnershipError(f"{why}. Publishing stops for the rest of this job")
        self.engine.stop(error)
        if not self.config.keep_training_on_error:
            raise error
        log.error("hotload: %s (keep_training_on_error: training goes on)", error)

    def _warn_about_model(self) -> None:
        """Said once, on rank 0: settings under which the fleet would serve something other than the trained
        policy without any error (a lossy dtype cast, a glob that matches nothing, unmerged LoRA adapters, an
        ``lm_head`` that FSDP1 may have untied from the embedding), and names the fleet's loader would refuse on
        every publish (tensors that are not the base checkpoint's, or, without its weights in ``hf_config_dir``,
        not those transformers would save for the model)."""
        plan = self.names_plan
        if plan is not None:
            what = [f"{plan.split_tensors} tensor(s) split into the checkpoint's"] if plan.split_tensors else []
            what += [f"{plan.joined} of the checkpoint's tensor(s) joined from the model's"] if plan.joined else []
            what += [f"{len(plan.changed)} name(s) changed, e.g. {a!r} to {b!r}"
                     for a, b in list(plan.changed.items())[:1]]
            if plan.transposed:
                log.info("hotload: publishing %d tensor(s) with their last two dims swapped, as the base checkpoint "
                         "stores them and transformers transposes them on loading (e.g. %r); hf_names=False turns "
                         "this off", len(plan.transposed), plan.transposed[0])
            else:
                log.info("hotload: publishing under the names transformers' save_pretrained writes for this model "
                         "(%s); hf_names=False turns this off", "; ".join(what))
        kw = {k: v for k, v in self._chunk_kwargs.items() if k not in ("snapshot_dtype", "dtype_overrides")}
        policy = DtypePolicy.of(self.config.snapshot_dtype, self.config.dtype_overrides)
        base = self._base()
        own = {k: v for k, v in self._chunk_kwargs.items() if k not in ("rename", "split")}
        # hf_names already checked the published names and shapes against transformers' (its plan gives those)
        saved = None if base is not None or plan is not None else transformers_saved_shapes(
            self.model, lambda: full_tensor_specs(self.model, **own))
        where = ("the base checkpoint in hf_config_dir" if base is not None else
                 "the tensors transformers' save_pretrained writes for this model")
        notes = [*policy.notes(source_dtypes(self.model, **kw)),
                 adapter_note(tensor_paths(self.model, include_buffers=False)),
                 fsdp1_untied_note(self.model, **kw),
                 names_note([*(name for name, _shape, _dtype in self._specs), *(t.name for t in self.engine.carried)],
                            base, saved=saved),
                 shapes_note(((name, shape) for name, shape, _dtype in self._specs), base or saved, where=where),
                 narrowed_note(((name, dtype) for name, _shape, dtype in self._specs),
                               self._base_tensors()[1])]
        for note in notes:
            if note:
                log.warning("hotload: %s", note)

    def _buffer_chunks(self, chunks: list[Any]) -> list[int]:
        """Chunks that read a module buffer. Forward passes update buffers (BatchNorm running statistics, step
        counters) in place, so a copy that overlaps the next forward would read them half updated. A DTensor
        buffer (tensor parallelism replicates the buffers of the modules it parallelises) is matched by its local
        tensor, which the chunk views: the wrapper itself has no storage to read."""
        held = (getattr(b, "_local_tensor", b) for b in self.model.buffers())
        ptrs = {storage_ptr(t) for t in held if t.numel()}
        return [i for i, c in enumerate(chunks) if c.source.numel() and storage_ptr(c.source) in ptrs]

    def _background_sources(self) -> list[torch.Tensor]:
        """The sources for a copy that overlaps the next forward: buffers are cloned now (they are small),
        parameters are read later (only the optimizer changes them, and its pre-step hook waits for the copy)."""
        views = list(self._sources())
        for i in self._buffer_idx:
            views[i] = views[i].detach().clone()
        return views

    def _sources(self) -> list[torch.Tensor]:
        # The views stay valid while every parameter and buffer is the same object on the same memory; a
        # framework or user that swaps storage changes the fingerprint, and the model is walked again.
        fingerprint = storage_fingerprint(self.model)
        if fingerprint != self._fingerprint:
            walked = local_chunks(self.model, **self._chunk_kwargs)
            self.walks += 1
            # The specs first: they are the same on every rank, so a replaced tensor fails every rank at this
            # step, also those that hold none of it (a replicated tensor is rank 0's alone).
            specs, layout = full_tensor_specs(self.model, **self._chunk_kwargs), [(c.name, c.box) for c in walked]
            if specs != self._specs or layout != self._layout:
                raise RuntimeError(f"the model's tensors or sharding changed since HotloadCallback was created "
                                   f"({_what_changed(self._specs, specs, self._layout, layout)}); create a new one")
            chunks = [walked[i] for i in self._kept]
            self._views, self._fingerprint = [c.source for c in chunks], fingerprint
            self._buffer_idx = self._buffer_chunks(chunks)
            # Called by the engine after its fence, so no copy reads the old views: its copy plans let go of them.
            self.engine.stager.rebind(self._views)
        return self._views

    def attach(self, *optimizers: torch.optim.Optimizer, first_step: int | None = None) -> None:
        """Publish from the optimizers' step hooks (``register_step_pre_hook`` / ``register_step_post_hook``).

        Pass every optimizer that updates the model (e.g. Muon for matrices and AdamW for the rest): a snapshot
        is taken once all of them have stepped since the last one, so it never mixes two steps. Calling
        ``attach`` again replaces the earlier optimizers (after an optimizer is re-created, say). Optimizers
        stepped during backward (one per parameter) are attached alike where every parameter gets a gradient at
        every step; where one may not, its optimizer holds the snapshot back, so call ``step()`` after backward.

        Steps are counted from ``first_step`` (pass the resumed step when training restarts from a
        checkpoint, so identities carry the real step), else from where ``step()`` or an earlier attach left
        off (0 at first). Only steps the optimizers take count: a step a ``GradScaler`` skips (inf gradients)
        does not, so identities then lag the trainer's step; call ``step(global_step)`` instead where that matters.
        With several optimizers and a ``GradScaler``, call ``step(global_step)`` after ``scaler.update()`` and do
        not attach: the scaler checks each optimizer's gradients apart, and once it skips one optimizer but not
        another, "all have stepped" falls between two optimizers' steps and every later snapshot mixes two steps.

        With ``config.async_copy`` (the default) a CPU copy of the shard runs on a helper thread while the
        next forward and backward run, and a step pre-hook makes the next ``optimizer.step()`` wait for it,
        so the trainer's thread blocks only if the copy is not done by then. The optimizer must own every
        published parameter, and nothing else may modify them in place between two optimizer steps; buffers,
        which forward passes update, are cloned at the hook instead.

        A failed publish's error (unless ``config.keep_training_on_error``) is raised from the post-step hook, so
        from inside ``optimizer.step()`` (or ``scaler.step()``) once the step's update is applied: what follows it
        in the same ``try`` (``scaler.update()``, a scheduler's step) does not run, and a loop that catches the
        error and goes on must still call them. With a fused optimizer (``fused=True``) a step the scaler skips
        still runs the optimizer's step, and its hooks: it counts, and publishes an unchanged snapshot.

        With several ranks and ``busy_policy="skip"``, the pre-step hook also starts the ranks' agreement on
        whether the previous snapshot has finished, a forward and backward later than ``step()`` can: a
        publisher that keeps up publishes every step (``step()`` publishes at most every second step).
        """
        if not optimizers:
            raise TypeError("attach() needs at least one optimizer")
        if len({id(o) for o in optimizers}) != len(optimizers):
            raise ValueError("attach() was given the same optimizer twice")
        if self.engine.closed:
            raise RuntimeError("HotloadCallback is closed: create a new one to publish again")
        # checked here, as step() checks its steps: a float is refused, not truncated, and a step already taken is
        # refused now, not from inside the first optimizer.step()
        start = None if first_step is None else self.engine.checked_step(first_step)
        self.detach()
        if start is not None:
            self._step = start
        for opt in optimizers:
            for other in attached(opt):
                if other is not self and (why := _clash(other.config, self.config)) is not None:
                    log.warning("hotload: another HotloadCallback %s was attached to this optimizer; its hooks are "
                                "removed (close() it to stop its threads): two would publish every step there, "
                                "each failing the other's deltas", why)
                    other.detach()
        self._warn_unstepped(optimizers)
        background = self.config.async_copy
        # its own switch, which detach() turns off for good: a part an earlier attach() left on an optimizer
        # (detached from another thread than the one stepping it) stays dead when this one turns _hooks_on on
        self._attachment = att = Attachment(self, len(optimizers), fence=self.fence,
                                            agree=lambda: self.engine.agree(self._step),
                                            publish=lambda: self._publish(None, background_copy=background))
        self._hooks_on = True
        hook(att, optimizers)
        self._watches = [watch(self, opt) for opt in optimizers]
        self.engine.early_agreement = True

    def _warn_unstepped(self, optimizers: tuple[torch.optim.Optimizer, ...]) -> None:
        """Trainable parameters that none of ``optimizers`` updates are published as they stand at each of their
        steps: stale by a step, or read while another optimizer changes them (its step not waited for)."""
        owned = {id(p) for opt in optimizers for group in opt.param_groups for p in group["params"]}
        missed = [name for name, p in self.model.named_parameters() if p.requires_grad and id(p) not in owned]
        if missed:
            log.warning("hotload: %d trainable parameter(s) are not updated by the optimizer(s) given to attach(), "
                        "e.g. %s: attach every optimizer that updates the model, or they are published a step "
                        "late (or mid-update)", len(missed), ", ".join(missed[:3]))

    def detach(self) -> None:
        """Remove the optimizer hooks of :meth:`attach` (waiting for a copy still reading the weights).

        The pre-step part goes last, once that copy is done: when this runs on another thread than training
        (close() from a watchdog), the trainer's next optimizer step must still wait for the copy instead of
        changing the weights under it (the snapshot would hold the next step's weights under this step's name).
        The hooks leave the optimizer when this runs on the thread that steps it; from another they stay on it,
        fencing the trainer's next step, then running nothing and keeping nothing of this callback alive
        (:mod:`fsdp_hotload.callback_hooks`)."""
        att, self._attachment = self._attachment, None
        self._hooks_on = False
        if att is not None:
            att.live = False  # from here its post-hooks publish nothing, whichever thread trains
        for gone in self._watches:
            gone.detach()
        self._watches = []
        _ORPHANED.discard(self)
        self.engine.early_agreement = False
        self.fence()
        if att is not None:  # its pre-hooks fenced until here; removed where this thread may (callback_hooks)
            release(att)

    def fence(self) -> float:
        """Wait until the last staged copy has read the weights; returns seconds waited (0 when it was done)."""
        return self.engine.fence()

    def wait(self, timeout: float | None = None) -> None:
        """Block until in-flight snapshots finished (for tests and for the end of training)."""
        self.engine.wait(timeout)

    def close(self, *, raise_errors: bool = True, timeout: float | None = None) -> None:
        """Publish the newest step if it was skipped (``config.publish_on_close``), wait for in-flight snapshots,
        stop the background threads, and free the side groups. Call it on the training thread of every rank (the
        one that publishes the steps); from another thread (a watchdog) it publishes nothing more, since the
        weights may be changing under its copy.

        ``timeout`` (default ``config.close_timeout_s``) bounds the wait: past it, the snapshots in flight are
        abandoned and PublishError is raised; the side groups are then left for the process's exit, since a
        stuck thread may still be in one of their collectives. It bounds the ranks' vote on the newest step too.
        Closing on an exception (or with ``raise_errors=False``) does not vote, and tells the other ranks so."""
        self._close(raise_errors, timeout, None)

    def _close(self, raise_errors: bool, timeout: float | None, propagating: bool | None) -> None:
        self.detach()
        if self.engine.world > 1 and not self.engine.closed and not torch.distributed.is_initialized():
            propagating = sys.exc_info()[1] is not None if propagating is None else propagating
            return self._close_destroyed(timeout, raise_errors and not propagating)
        try:
            self.engine.close(raise_errors=raise_errors, sources=self._sources, timeout=timeout,
                              propagating=propagating)
        finally:
            if self.engine.closed:
                # the views keep the model's memory alive (a whole shard, on a GPU): a closed callback that its
                # owner still holds must not, once the model has let go of that memory
                self._views, self._fingerprint = [], None
                self._recheck.finish(close=not self.engine.abandoned)
                if not self.engine.abandoned:
                    self._close_comms()

    def _close_destroyed(self, timeout: float | None, raise_errors: bool) -> None:
        """close() after ``destroy_process_group()``, which destroyed the side groups too: nothing more can be
        published, the threads still stop, and the error says why instead of "Group ... is not registered".
        Only logged when closing on an exception, or with ``raise_errors=False``: the caller's error must not be
        replaced by this one."""
        from .engine.jobs import PublishError

        newest, staged, in_flight = self.engine.latest_step, self.engine._last_staged, self.engine._pending
        self._comms.clear()  # destroyed already: destroying them again only logs warnings
        try:
            self.engine.close(raise_errors=False, timeout=timeout)
        finally:
            self._views, self._fingerprint = [], None
            self._recheck.finish(close=False)
        if newest > staged and self.config.publish_on_close:
            lost = f"step {newest} is not published"
        elif in_flight:
            lost = f"{in_flight} snapshot(s) in flight may not reach the fleet"
        else:
            return  # nothing was left to publish
        if not raise_errors:
            log.warning("hotload: close() ran after torch.distributed.destroy_process_group(), which destroyed "
                        "hotload's side groups too, so %s: call close() first", lost)
            return
        raise PublishError("close() ran after torch.distributed.destroy_process_group(), which destroyed "
                           f"hotload's side groups too, so {lost}: call close() first")

    def _close_comms(self) -> None:
        comms = list(self._comms)
        self._comms.clear()  # in place: the list is the one the drop finalizer holds
        for comm in comms:
            try:
                comm.close()
            except Exception:  # noqa: BLE001 - a group that cannot be destroyed must not hide the real outcome
                log.warning("hotload: could not destroy a side process group", exc_info=True)

    @property
    def metrics(self) -> list[PublishMetrics]:
        """Per-publish records (filled on rank 0)."""
        return self.engine.metrics.records

    def __enter__(self) -> "HotloadCallback":
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        # Told, not read from sys.exc_info(): a with block that ends cleanly inside an except clause still
        # publishes its newest step (and votes with the other ranks).
        self._close(exc_type is None, None, exc_type is not None)
