"""Routing predictors for NetMoE sample placement (adapt/moe_placement.py). No torch.

`RoutingTable`: per token id, the expected token-slots per expert summed over the MoE layers (an
exponential average over steps): a new sample's counts c[i, e] before its forward. Only the rank
that places the samples holds the table, and a step's routing reaches it compactly
(`update_bytes` prices the three forms against all-reducing the V x (E + 1) table): as a
`RoutingUpdate`, the token ids the step saw, each with its slots per expert and occurrences (n
(E + 2) integers for n distinct ids, gathered), or, with `buckets`, ids hashed into that many
rows (a multiplicative hash, `hash_key`) and the bucket counts reduced: bounded whatever the
vocabulary, ids sharing a row share a prediction. The runtime hashes vocabularies above
`EXACT_UP_TO_IDS` ids into `HASHED_BUCKETS` rows.

`LayerTransition`: a sample's slots per expert in the next MoE layer from its tokens' experts in
this one (per-layer placement).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_HASH = 0x9E3779B1  # Knuth's multiplicative hash (2^32 / golden ratio)


@dataclass
class RoutingUpdate:
    """One step's routing by distinct key: `keys` (n,), `slots` (n, E) token-slots summed over
    layers and occurrences, `seen` (n,) occurrences counted once per layer."""

    keys: np.ndarray
    slots: np.ndarray
    seen: np.ndarray

    def packed(self) -> np.ndarray:
        """(n, E + 2) int32 rows [key, seen, slots...] (what a process sends)."""
        return np.concatenate([self.keys[:, None], self.seen[:, None], self.slots], 1).astype(np.int32)

    @classmethod
    def unpack(cls, rows: np.ndarray) -> "RoutingUpdate":
        """From `packed` rows of any processes, concatenated; rows with a negative key are padding."""
        rows = np.asarray(rows, dtype=np.int64)
        rows = rows[rows[:, 0] >= 0]
        return cls.merge([cls(keys=rows[:, 0], seen=rows[:, 1], slots=rows[:, 2:])])

    @classmethod
    def merge(cls, updates: list["RoutingUpdate"]) -> "RoutingUpdate":
        """The sum of updates, one row per key."""
        keys = np.concatenate([u.keys for u in updates])
        uniq, inv = np.unique(keys, return_inverse=True)
        slots = np.zeros((len(uniq), updates[0].slots.shape[1]), dtype=np.int64)
        np.add.at(slots, inv, np.concatenate([u.slots for u in updates]))
        return cls(keys=uniq, slots=slots, seen=np.bincount(inv, np.concatenate([u.seen for u in updates]),
                                                            minlength=len(uniq)).astype(np.int64))


# Above this many ids the runtime hashes them into `HASHED_BUCKETS` rows (SamplePlacer).
EXACT_UP_TO_IDS = 65536
HASHED_BUCKETS = 16384


def hash_key(tokens, buckets: int):
    """The row of token ids in a table of `buckets` rows: ((id * 0x9E3779B1) mod 2^32) mod buckets
    (numpy arrays or torch tensors of int64)."""
    return ((tokens * _HASH) % (1 << 32)) % buckets


class RoutingTable:
    """Per token key, the expected token-slots per expert over the MoE layers (module docstring)."""

    def __init__(self, vocab_size: int, num_experts: int, decay: float = 0.5, buckets: int | None = None):
        if buckets is not None and buckets < 1:
            raise ValueError(f"buckets must be >= 1, got {buckets}")
        self.vocab_size, self.num_experts, self.decay = vocab_size, num_experts, decay
        self.buckets = buckets if buckets is not None and buckets < vocab_size else None
        rows = self.buckets or vocab_size
        self.slots = np.zeros((rows, num_experts), dtype=np.float32)
        self.seen = np.zeros(rows)

    def key(self, tokens: np.ndarray) -> np.ndarray:
        tokens = np.asarray(tokens, dtype=np.int64)
        return tokens if self.buckets is None else hash_key(tokens, self.buckets)

    def observed(self, tokens: np.ndarray, chosen: np.ndarray) -> RoutingUpdate:
        """The update of tokens (..., S) ids routed to chosen (L, ..., S, k) experts by L layers."""
        keys = self.key(np.asarray(tokens).ravel())
        chosen = np.asarray(chosen)
        layers, k, e = chosen.shape[0], chosen.shape[-1], self.num_experts
        uniq, inv = np.unique(keys, return_inverse=True)
        flat = chosen.reshape(layers, -1, k)
        index = (np.repeat(inv, k)[None, :] * e + flat.reshape(layers, -1)).ravel()
        slots = np.bincount(index, minlength=len(uniq) * e).reshape(len(uniq), e)
        return RoutingUpdate(keys=uniq, slots=slots, seen=np.bincount(inv, minlength=len(uniq)) * layers)

    def update(self, tokens: np.ndarray, chosen: np.ndarray) -> None:
        """tokens (N, S) ids; chosen (L, N, S, k) expert ids the step's MoE layers routed them to."""
        self.apply(self.observed(tokens, chosen), layers=np.asarray(chosen).shape[0])

    def apply_dense(self, slots: np.ndarray, seen: np.ndarray, layers: int) -> None:
        """Merge a step's update given for every row (slots (R, E), seen (R,)), zero rows unseen."""
        rows = np.flatnonzero(seen > 0)
        self.apply(RoutingUpdate(keys=rows, slots=slots[rows], seen=seen[rows]), layers)

    def apply(self, update: RoutingUpdate, layers: int) -> None:
        """Merge a step's update, whose occurrences were counted in `layers` MoE layers."""
        rows = update.keys
        if not len(rows):
            return
        occurrences = update.seen / layers
        mean = update.slots / occurrences[:, None]
        keep = np.where(self.seen[rows] > 0, self.decay, 0.0)[:, None]
        self.slots[rows] = keep * self.slots[rows] + (1 - keep) * mean
        self.seen[rows] += occurrences

    def predict(self, tokens: np.ndarray) -> np.ndarray:
        """c (N, E): the predicted token-slots per expert of each sample (unseen tokens: the mean)."""
        rows = self.key(tokens)
        known = self.seen > 0
        prior = self.slots[known].mean(0) if known.any() else np.zeros(self.num_experts, dtype=np.float32)
        values = self.slots[rows].astype(float)
        values[~known[rows]] = prior
        return values.sum(axis=-2)


def update_bytes(distinct_keys: np.ndarray, num_experts: int, vocab_size: int, world: int,
                 buckets: int = HASHED_BUCKETS) -> dict:
    """Bytes of one step's table update (module docstring), sent per process and received at the
    placing rank: dense, an all-reduce of the V x (E + 1) table in fp64 (a ring sends and receives
    2 (p - 1) / p of it on every rank); sparse, a gather of each process's distinct keys padded to
    the largest count, (E + 2) int32 each, all of which the placing rank receives; hashed, a reduce
    of the `buckets` x (E + 1) int32 counts to the placing rank (a ring or tree: about the table
    once per rank). `distinct_keys` (world,): distinct ids each process saw."""
    ring = 2.0 * (world - 1) / world * vocab_size * (num_experts + 1) * 8.0
    padded = float(np.max(distinct_keys)) * (num_experts + 2) * 4.0
    hashed = buckets * (num_experts + 1) * 4.0
    return {"dense": (ring, ring), "sparse": (padded, padded * (world - 1)), "hashed": (hashed, hashed)}


class LayerTransition:
    """Predicts a sample's slots per expert in the next MoE layer from its tokens' experts in this
    one: M[e, f] = the mean slots a token that chose e here sends to f there (from earlier steps,
    an exponential average per step), and a sample's prediction is (c_l M) / k, each of a token's
    k slots predicting its k slots there. Without observations: uniform."""

    def __init__(self, num_layers: int, num_experts: int, top_k: int, decay: float = 0.5):
        self.num_experts, self.top_k, self.decay = num_experts, top_k, decay
        self.matrix = np.full((max(num_layers - 1, 0), num_experts, num_experts), top_k / num_experts)
        self.seen = np.zeros(max(num_layers - 1, 0), dtype=bool)

    @staticmethod
    def observed(chosen: np.ndarray, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
        """(pairs (L-1, E, E): slots to f in layer l+1 of tokens with e in layer l, uses (L-1, E):
        tokens with e in layer l) of routing chosen (L, ..., k)."""
        chosen = np.asarray(chosen)
        layers, k = chosen.shape[0], chosen.shape[-1]
        flat = chosen.reshape(layers, -1, k)
        onehot = np.zeros((layers, flat.shape[1], num_experts))
        for j in range(k):
            np.add.at(onehot, (np.arange(layers)[:, None], np.arange(flat.shape[1])[None, :], flat[..., j]), 1.0)
        pairs = np.einsum("ltf,lte->lef", onehot[1:], onehot[:-1]) if layers > 1 else np.zeros((0,) * 3)
        return pairs, onehot[:-1].sum(1)

    def update(self, pairs: np.ndarray, uses: np.ndarray) -> None:
        for layer in range(len(self.matrix)):
            hit = uses[layer] > 0
            if not hit.any():
                continue
            mean = pairs[layer][hit] / uses[layer][hit, None]
            keep = self.decay if self.seen[layer] else 0.0
            self.matrix[layer][hit] = keep * self.matrix[layer][hit] + (1 - keep) * mean
            self.seen[layer] = True

    def predict(self, layer: int, counts: np.ndarray) -> np.ndarray:
        """(N, E) predicted slots in MoE layer `layer` + 1 from counts (N, E) of layer `layer`."""
        return np.asarray(counts, dtype=float) @ self.matrix[layer] / self.top_k
