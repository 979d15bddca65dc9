"""The corpus' heavy programs (`HEAVY` in the program: a compile of seconds on every
path, the U-Net's; the 39 tables of the Deep & Cross Network) through
tests/integration/test_corpus.py's tests, in a module of their own: the suite gives
each module to one test process, so they train beside the others instead of after
them. Not here: the 2-worker cluster (the U-Net's PyDataset on 2 workers:
tests/integration/test_loaders.py; the MovieLens recommenders take it for the
recommenders) and the pipeline's export."""

from __future__ import annotations

import pytest

from tests.integration import test_corpus as corpus
from tests.integration.test_corpus import references, runs  # noqa: F401  (this module's own)

HEAVY = [name for name in corpus.PROGRAMS if name not in corpus.LIGHT]


@pytest.mark.slow
@pytest.mark.parametrize("name", HEAVY)
def test_mirrored_matches_plain_keras(name, runs, references):  # noqa: F811
    corpus.test_mirrored_matches_plain_keras(name, runs, references)


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name in HEAVY if name in corpus.CHAINS])
def test_pipeline_matches_plain_keras(name, runs, references):  # noqa: F811
    corpus.test_pipeline_matches_plain_keras(name, runs, references)


@pytest.mark.slow
@pytest.mark.parametrize("name", HEAVY)
def test_export_serves_the_trained_model(name, runs, tmp_path, capsys):  # noqa: F811
    corpus.test_export_serves_the_trained_model(name, "mirrored", runs, tmp_path, capsys)


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name in HEAVY if name in corpus.LAZY])
def test_lazy_updates_train_the_recommenders(name, runs, references, tmp_path,  # noqa: F811
                                             capsys):
    corpus.test_lazy_updates_train_the_recommenders(name, runs, references, tmp_path, capsys)


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name in HEAVY if name in corpus.LAZY])
def test_sharded_tables_train_the_recommenders(name, runs, tmp_path, capsys):  # noqa: F811
    corpus.test_sharded_tables_train_the_recommenders(name, runs, tmp_path, capsys)
