"""Byte-level data: the Python standard library's own sources as a corpus, synthetic batches for
tests, and the one rule that splits a global batch over data-parallel ranks and micro-batches.

    from tinyscale.data import stdlib_corpus, sample_batches, local_micro_batches
    batches = sample_batches(stdlib_corpus("train").tokens, num_batches=10, batch_size=8, seq_len=64, seed=0)
    mine = local_micro_batches(batches[0], dp_rank=1, dp_size=2, micro_batch_size=2)
"""

from tinyscale.data.corpus import VOCAB_SIZE, Corpus, corpus_info, decode, sample_batches, stdlib_corpus
from tinyscale.data.split import local_micro_batches, micro_batches, shard_rows
from tinyscale.data.synthetic import check_token_ids, synthetic_regression_batches, synthetic_token_batches

__all__ = [
    "VOCAB_SIZE",
    "Corpus",
    "stdlib_corpus",
    "corpus_info",
    "decode",
    "sample_batches",
    "synthetic_token_batches",
    "synthetic_regression_batches",
    "check_token_ids",
    "shard_rows",
    "micro_batches",
    "local_micro_batches",
]
