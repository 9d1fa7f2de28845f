"""Balanced data-parallel loaders (runtime/balanced_data.py): rows to ranks by predicted time, the
global batch unchanged; and the adaptive runtime's handling of documents no plan holds."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tessera.errors import TesseraError
from tessera.runtime.adaptive import fit_documents
from tessera.runtime.balanced_data import BalancedLoader, row_costs
from tessera.runtime.data import build_dataloader
from tessera.runtime.tokenizer import EOT_ID

SEQ, GLOBAL, RANKS, MICRO = 64, 16, 4, 2
LIN, ATTN = 1.0, 0.05  # per token, per token**2: a 64-token document costs 3.2x its tokens


@pytest.fixture(scope="module")
def stream_dir(tmp_path_factory):
    """A token file of documents from 2 to 64 tokens, long ones clustered: contiguous rows differ in work."""
    rng = np.random.default_rng(0)
    parts = []
    for k in range(400):
        n = int(rng.integers(48, 65)) if (k // 20) % 3 == 0 else int(rng.integers(2, 10))
        parts += [EOT_ID] + rng.integers(0, 50000, n).tolist()
    root = tmp_path_factory.mktemp("tokens")
    np.save(root / "docs.npy", np.array(parts, dtype=np.int64))
    return root


def _loader(root, rank=0, size=1):
    return build_dataloader(str(root), SEQ, GLOBAL, rank, size, seed=3)


def test_every_rank_gets_its_share_and_the_global_batch_is_unchanged(stream_dir):
    loaders = [BalancedLoader(_loader(stream_dir), r, RANKS, MICRO, LIN, ATTN) for r in range(RANKS)]
    plain = [_loader(stream_dir, r, RANKS) for r in range(RANKS)]
    for _ in range(3):
        mine = [next(loader) for loader in loaders]
        base = [next(loader) for loader in plain]
        assert all(b.tokens.shape == (GLOBAL // RANKS, SEQ) for b in mine)
        rows = lambda batches: sorted(tuple(r) for b in batches for r in b.tokens.tolist())  # noqa: E731
        assert rows(mine) == rows(base)  # the same global batch, rows permuted across ranks
        times = mine[0].rank_times_s
        assert all(b.rank_times_s == times for b in mine) and len(times) == RANKS
        contiguous = [row_costs(b.doc_ids, LIN, ATTN).sum() for b in base]
        assert max(times) <= max(contiguous) + 1e-9
        assert sum(times) == pytest.approx(sum(contiguous))
        for r, b in enumerate(mine):  # what each rank holds is what the balancer predicted for it
            assert row_costs(b.doc_ids, LIN, ATTN).sum() == pytest.approx(times[r])
    assert loaders[0].state_dict() == plain[0].state_dict()  # the data position is the loader's


def test_balance_lowers_the_slowest_rank_on_mixed_rows(stream_dir):
    loader = BalancedLoader(_loader(stream_dir), 0, RANKS, 1, LIN, ATTN)
    plain = [_loader(stream_dir, r, RANKS) for r in range(RANKS)]
    ratios = []
    for _ in range(6):
        times = next(loader).rank_times_s
        contiguous = [row_costs(next(p).doc_ids, LIN, ATTN).sum() for p in plain]
        ratios.append((max(times) / np.mean(times), max(contiguous) / np.mean(contiguous)))
    balanced, before = np.mean(ratios, axis=0)
    assert balanced < before and balanced < 1.05, ratios


def _docs(*lens):
    return [(torch.arange(n), torch.arange(n)) for n in lens]


def test_documents_no_plan_holds_are_refused_skipped_or_truncated():
    docs = _docs(5, 40, 12)
    with pytest.raises(TesseraError, match="step 3: a document of 40 tokens does not fit in memory under any "
                                           "plan: the longest that fits is 16 tokens"):
        fit_documents(docs, 16, "error", 3)
    assert [x.numel() for x, _ in fit_documents(docs, 16, "skip", 3)] == [5, 12]
    truncated = fit_documents(docs, 16, "truncate", 3)
    assert [x.numel() for x, _ in truncated] == [5, 16, 12] and truncated[1][0].tolist() == list(range(16))
    assert fit_documents(docs, 64, "error", 3) is docs
    with pytest.raises(TesseraError, match="every document is longer than the 4 tokens that fit"):
        fit_documents(docs, 4, "skip", 3)
