"""Python and CLI misuse from issue 30: a cache reused across model.generate() calls, and
--batch-file lines holding characters that str.splitlines() would split at."""

import argparse

import pytest
import torch

from kivi_models import make_cache, patch_model
from kivi_cli.args import read_prompts
from kivi_ops import KIVIConfig
from tiny_models import tiny_llama


@pytest.fixture(scope="module")
def tiny():
    return patch_model(tiny_llama(vocab_size=128))


def generate(model, cache, prompt):
    ids = torch.tensor([prompt])
    out = model.generate(ids, max_new_tokens=10, do_sample=False, past_key_values=cache, disable_compile=True,
                         pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def fresh_cache(model):
    return make_cache(model, method="kivi", batch_size=1, max_seq_len=64, kivi_config=KIVIConfig(group_size=4,
                                                                                                 residual_length=4))


def test_a_cache_reused_for_new_prompts_gives_each_prompt_its_own_answer(tiny):
    first, longer, shorter = list(range(3, 15)), list(range(20, 40)), [5, 6, 7]
    reused = fresh_cache(tiny)
    answers = [generate(tiny, reused, prompt) for prompt in (first, longer, shorter)]
    # Without the reset, the longer prompt would continue the first one's state (the model saw stale
    # tokens plus the prompt's tail) and the shorter one would raise a RuntimeError in transformers.
    assert answers == [generate(tiny, fresh_cache(tiny), prompt) for prompt in (first, longer, shorter)]


def test_a_continuation_through_a_reused_cache_is_the_whole_sequence_again(tiny):
    """transformers' idiom: pass the earlier output plus new ids with the same cache; the reset
    reruns the whole sequence, which gives what a fresh cache gives."""
    cache = fresh_cache(tiny)
    prompt = list(range(3, 15))
    follow_up = prompt + generate(tiny, cache, prompt) + [9, 10]
    assert generate(tiny, cache, follow_up) == generate(tiny, fresh_cache(tiny), follow_up)


def prompts_of(tmp_path, text: str):
    batch = tmp_path / "batch.txt"
    batch.write_bytes(text.encode("utf-8"))
    parser = argparse.ArgumentParser()
    args = argparse.Namespace(prompt=None, prompt_file=None, batch_file=str(batch))
    return read_prompts(args, parser)


@pytest.mark.parametrize("text, lines", [
    ("one\x0cpage\nline\u2028sep\nnext\x1cfile\x1dgroup\x1erecord\x85nel\n",
     ["one\x0cpage", "line\u2028sep", "next\x1cfile\x1dgroup\x1erecord\x85nel"]),
    ("windows\r\nline\u2029two\r\n", ["windows", "line\u2029two"]),
    ("no final newline\nsecond", ["no final newline", "second"]),
    ("a\x0bvertical tab", ["a\x0bvertical tab"]),
])
def test_batch_file_splits_on_newlines_only(tmp_path, text, lines):
    assert prompts_of(tmp_path, text) == lines


def test_batch_file_blank_line_is_still_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        prompts_of(tmp_path, "one\n\ntwo\n")
    assert "line(s) 2 are blank" in capsys.readouterr().err


def test_kivi_generate_degenerate_temperature_and_top_p_give_the_greedy_tokens(capsys):
    """--temperature 1e-45 made every logit / temperature overflow (NaN: token 0 repeated, exit 0);
    --top-p 1e-46 rounded to 0 in float32 and kept no token. Both tend to greedy and now give it."""
    import json

    from kivi_cli.main import main

    def tokens(*sampling):
        argv = ["generate", "--prompt", "The capital of France is", "--max-new-tokens", "6", "--method", "fp", "--json"]
        assert main([*argv, *sampling]) == 0
        return json.loads(capsys.readouterr().out)["tokens"]

    greedy = tokens()
    assert len(set(greedy)) > 1  # a real answer, not one token repeated
    assert tokens("--temperature", "1e-45", "--seed", "1") == greedy
    assert tokens("--temperature", "1", "--top-p", "1e-46", "--seed", "1") == greedy
