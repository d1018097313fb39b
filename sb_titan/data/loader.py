"""The recipe's data loader: a torchdata.nodes chain wrapped as TorchTitan's BaseDataLoader.

    StepPlanNode (the balancer's next step: global plan and budgets, metadata only)
      → RankMicrobatchNode (this rank's micro-batches of each step, in order)
      → Mapper(pack: read this rank's tokens, build rows)
      → Prefetcher → Loader

One item is one micro-batch: `({"input", "positions", "scheduled", ...}, labels)`; the
step's ScheduledStep (global plan + budgets of every rank) rides along for logging and
measurement. The loader decides nothing: it asks the run's Balancer (balance/balancer.py)
for each step, in the prefetch thread, off the training step's critical path, and
packs what it decided.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torchdata.nodes import BaseNode, Loader, Mapper, Prefetcher
from torchtitan.components.tokenizer import HuggingFaceTokenizer

from sb_titan.balance.balancer import Balancer, ScheduledStep
from sb_titan.balance.sab import MicroBatchPlan, SABConfig
from sb_titan.balance.step_shape import StepShape
from sb_titan.compat.data import BaseDataLoader, stop_prefetcher
from sb_titan.data.source import TokenSource

IGNORE_INDEX = -100
STATE_KEY = "plan"
"""The loader's one checkpoint key (`dataloader.plan` in DCP's flat state)."""


class StepPlanNode(BaseNode[ScheduledStep]):
    """Yields the balancer's scheduled steps; its state is the plan state (exact
    resume: the cost-model snapshots a re-planned step needs are in the trainer's
    checkpoint)."""

    def __init__(self, balancer: Balancer) -> None:
        super().__init__()
        self.balancer = balancer
        self._generation = 0  # bumped by reset: a planner still waiting is stale

    def reset(self, initial_state: dict | None = None) -> None:
        super().reset(initial_state)
        self._generation += 1  # only reset writes it
        self.balancer.load_plan_state(initial_state["planner"] if initial_state else None)

    def next(self) -> ScheduledStep:
        generation = self._generation
        return self.balancer.next_step(cancelled=lambda: self._generation != generation)

    def get_state(self) -> dict[str, Any]:
        return {"planner": self.balancer.plan_state()}


class RankMicrobatchNode(BaseNode[tuple[ScheduledStep, int]]):
    """Flattens scheduled steps into (step, micro-batch index) for one DP rank."""

    def __init__(self, source: StepPlanNode, dp_rank: int) -> None:
        super().__init__()
        self.source = source
        self.dp_rank = dp_rank

    def reset(self, initial_state: dict | None = None) -> None:
        super().reset(initial_state)
        self._step: ScheduledStep | None = None
        self._index = 0
        # Re-plan the step that was in progress, then skip what was already yielded.
        self._before = initial_state["source"] if initial_state else None
        self.source.reset(self._before)
        if initial_state and initial_state["index"] > 0:
            self._pull()
            self._index = initial_state["index"]

    def _pull(self) -> None:
        self._before = self.source.get_state()
        self._step = self.source.next()
        self._index = 0

    def _at_boundary(self) -> bool:
        return self._step is None or self._index == len(self._step.plan.microbatches[self.dp_rank])

    def next(self) -> tuple[ScheduledStep, int]:
        if self._at_boundary():
            self._pull()
        item = (self._step, self._index)
        self._index += 1
        return item

    def get_state(self) -> dict[str, Any]:
        if self._at_boundary():
            return {"source": self.source.get_state(), "index": 0}
        return {"source": self._before, "index": self._index}


def pack_microbatch(
    source: TokenSource, mb: MicroBatchPlan, seq_len: int, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of [seq_len]: tokens, labels (next token within a piece) and positions.

    Positions restart at 0 at every piece, so attention (which derives documents from
    positions) never crosses a document or reaches into padding. A source with a loss
    mask (supervised fine-tuning data) leaves labels that are not targets at
    IGNORE_INDEX: TorchTitan's loss skips them and counts only the others.
    """
    loss_mask = getattr(source, "loss_mask", None)
    n_rows = len(mb.rows)
    tokens = np.full((n_rows, seq_len), pad_id, dtype=np.int64)
    labels = np.full((n_rows, seq_len), IGNORE_INDEX, dtype=np.int64)
    positions = np.zeros((n_rows, seq_len), dtype=np.int64)
    for r, row in enumerate(mb.rows):
        at = 0
        for piece in row:
            t = source.read(piece.sample_id, piece.start, piece.length)
            if len(t) != piece.length:
                raise ValueError(
                    f"{source.name}: sample {piece.sample_id} returned {len(t)} tokens "
                    f"for [{piece.start}, {piece.start + piece.length})"
                )
            tokens[r, at : at + piece.length] = t
            labels[r, at : at + piece.length - 1] = t[1:]
            keep = loss_mask and loss_mask(piece.sample_id, piece.start, piece.length)
            if keep is not None:  # label i is token i + 1: a target where that token is
                labels[r, at : at + piece.length - 1][~keep[1:]] = IGNORE_INDEX
            positions[r, at : at + piece.length] = np.arange(piece.length)
            at += piece.length
        # positions stay 0 over the padding: every pad token is its own document, so
        # sparse attention spends only diagonal blocks on it (no quadratic padding cost).
    return torch.from_numpy(tokens), torch.from_numpy(labels), torch.from_numpy(positions)


class SBDataLoader(BaseDataLoader):
    """Packs this rank's micro-batches of every step the balancer plans globally."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        dataset: str = "synthetic"
        """`synthetic` (bundled longtail-v1 corpus) or `indexed` (an sb-prep output dir)."""
        dataset_path: str | None = None
        synthetic_docs: int = 20000
        """Number of synthetic documents (one epoch)."""
        synthetic_seed: int = 0
        synthetic_fact_every: int = 256
        """One key-value fact per this many tokens of a synthetic document."""
        synthetic_recalls: int = 2
        """Facts recalled at the end of each synthetic document (a recall-dense mix, e.g.
        fact_every 64 and recalls 16, teaches a base model the task in fewer steps)."""
        synthetic_doc_len: int = 0
        """0: longtail-v1 document lengths; N: every synthetic document is N <= seq_len
        tokens (the fixed-length stages of a pretraining curriculum)."""
        prefetch_factor: int = 2
        sample_log: bool = False
        """Write the pieces each rank trains on, per step, to dump_folder/samples_rank<r>.jsonl
        (what resume and cross-rank tests compare)."""

        def build(
            self,
            *,
            balancer: Balancer | None = None,
            source: TokenSource | None = None,
            **kwargs,
        ) -> SBDataLoader:
            """TorchTitan's build(); a trainer passes the run's balancer and the source
            it balances."""
            return SBDataLoader(self, balancer=balancer, source=source, **kwargs)

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int,
        dp_rank: int,
        tokenizer: HuggingFaceTokenizer | None,
        seq_len: int,
        local_batch_size: int,
        snapshot_every_n_steps: int | None = None,
        balancer: Balancer | None = None,
        source: TokenSource | None = None,
    ) -> None:
        self.config = config
        self.dp_rank = dp_rank
        self.seq_len = seq_len
        self.source = source or build_source(config, seq_len)
        pad = tokenizer.tokenizer.token_to_id("<|pad|>") if tokenizer is not None else None
        self.pad_id = 0 if pad is None else pad
        if balancer is None:  # built outside the trainer: one micro-batch per step, in order
            shape = StepShape(seq_len, dp_world_size, 1, local_batch_size)
            balancer = Balancer(self.source.lengths, shape, SABConfig(policy="sequential"))
        s = balancer.shape
        if (s.seq_len, s.dp, s.rows) != (seq_len, dp_world_size, local_batch_size):
            raise ValueError(
                f"the balancer plans steps of {s.dp} DP ranks x rows of {s.rows} x "
                f"{s.seq_len} tokens, but the loader was built for {dp_world_size} x "
                f"{local_batch_size} x {seq_len}"
            )
        self.balancer = balancer
        node: BaseNode = RankMicrobatchNode(StepPlanNode(balancer), dp_rank)
        node = Mapper(node, self._pack)
        self._root = Prefetcher(node, prefetch_factor=config.prefetch_factor)
        self.loader = Loader(self._root)

    def _pack(self, item: tuple[ScheduledStep, int]) -> tuple[dict[str, Any], torch.Tensor]:
        scheduled, index = item
        mb = scheduled.plan.microbatches[self.dp_rank][index]
        tokens, labels, positions = pack_microbatch(self.source, mb, self.seq_len, self.pad_id)
        batch = {"input": tokens, "positions": positions, "scheduled": scheduled}
        batch["microbatch"] = index
        return batch, labels

    def __iter__(self) -> Iterator[tuple[dict[str, Any], torch.Tensor]]:
        return iter(self.loader)

    def state_dict(self) -> dict[str, Any]:
        # One key for every rank: the plan is global (every DP rank plans the same steps
        # and observes the same gathered measurements, and a step boundary is one for all
        # of them), so DCP stores it once and any layout can read it back (a resume on
        # another DP size, checkpoint.reshard). Pickled so DCP stores it as bytes. The
        # planner's density store is taken live: per-item snapshots are made when an item
        # is produced, before the trainer observed the steps still in flight.
        state = {
            "loader": self.loader.state_dict(),
            "sab_densities": self.balancer.observation_state(),
        }
        return {STATE_KEY: pickle.dumps(state)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        if STATE_KEY not in state_dict:
            raise KeyError(
                f"data loader checkpoint has no {STATE_KEY!r} state (it has "
                f"{sorted(state_dict)}): saved by an older sb_titan, which kept one per DP rank"
            )
        # A fresh Loader: the checkpointer's state_dict() call (to build its load
        # template) already created an iterator that would otherwise ignore this state.
        self.loader = Loader(self._root)
        state = pickle.loads(state_dict[STATE_KEY])
        self.balancer.load_observation_state(state["sab_densities"])
        self.loader.load_state_dict(state["loader"])

    def close(self) -> None:
        """Stop the prefetch thread. Left running, it keeps planning and packing the
        next steps while the interpreter exits, and a daemon thread caught inside torch
        at exit can abort the process after training has finished."""
        self.balancer.close()  # a planner waiting for a snapshot gives up
        stop_prefetcher(self._root)


def build_source(config: SBDataLoader.Config, seq_len: int) -> TokenSource:
    if config.dataset == "synthetic":
        from sb_titan.data.synthetic import SyntheticCorpus

        doc_len = config.synthetic_doc_len
        if not 0 <= doc_len <= seq_len:
            raise ValueError(
                f"dataloader.synthetic_doc_len: {doc_len} must be 0 (longtail-v1 lengths) or "
                f"a document length <= training.seq_len ({seq_len})"
            )
        return SyntheticCorpus(
            config.synthetic_docs,
            seq_len,
            seed=config.synthetic_seed,
            lengths=np.full(config.synthetic_docs, doc_len) if doc_len else None,
            fact_every=config.synthetic_fact_every,
            recalls=config.synthetic_recalls,
        )
    if config.dataset == "indexed":
        from sb_titan.data.indexed import IndexedDataset

        if not config.dataset_path:
            raise ValueError(
                "dataloader.dataset_path: required when dataloader.dataset = 'indexed'"
            )
        if not os.path.isdir(config.dataset_path):
            raise ValueError(
                f"dataloader.dataset_path = {config.dataset_path}: dataset directory not "
                "found (sb-prep writes one)"
            )
        return IndexedDataset(config.dataset_path)
    raise ValueError(
        f"dataloader.dataset: unknown dataset {config.dataset!r}; expected 'synthetic' or 'indexed'"
    )
