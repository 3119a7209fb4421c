"""ModelConfig.gc_freeze: after start-up the engine's objects leave the collector's reach
(gc.freeze) so full collections skip them; closing the LLM gives them back (gc.unfreeze), and an
engine caught in a reference cycle is still collected then."""

from __future__ import annotations

import gc
import weakref

import pytest

from foretell import LLM, SamplingParams


@pytest.fixture(autouse=True)
def unfrozen():
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_on_freezes_after_start_up_and_close_unfreezes(qwen3_checkpoint):
    llm = LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=32, gc_freeze="on")
    assert llm.engine.gc_frozen and gc.get_freeze_count() > 0
    out = llm.generate(["a b c"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    engine = weakref.ref(llm.engine)
    llm.engine.cycle = llm.engine  # a reference cycle: only the collector frees it
    llm.close()
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert engine() is None


def test_auto_is_off_on_the_cpu_and_bad_values_are_refused(qwen3_checkpoint):
    llm = LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=32)
    assert not llm.engine.gc_frozen and gc.get_freeze_count() == 0
    with pytest.raises(ValueError, match="gc_freeze must be auto, on or off"):
        LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=32, gc_freeze="yes")


def test_cli_flag_reaches_the_config():
    import argparse

    from foretell.cli_args import add_engine_args, engine_kwargs_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser, model_required=False)
    assert engine_kwargs_from_args(parser.parse_args(["--gc-freeze", "off"]))["gc_freeze"] == "off"
