"""Real text for fine-tuning, in one process: a tokenizer, chats masked to the assistant's
tokens, packing without padding, the token cache, and bad data said in one line.

The model folder is ``scripts/make_tiny_hf.py``'s (the ``tiny_llama`` fixture): a BPE
tokenizer of 512 tokens whose ChatML template marks assistant turns with
``{% generation %}``, and ``chat.jsonl`` of real conversations.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import PLANS, run_main

import tpplan
from tpplan.plan.errors import PlanErrors
from tpplan.train.cache import CACHE_DIR
from tpplan.train.chat import render_chat
from tpplan.train.corpora import load_corpora
from tpplan.train.data import DataError, global_batch, local_batch, step_batch

SEQ = 32


def corpora(tmp_path: Path, *sets: str, vocab: int | None = 512, seq_len: int = SEQ):
    plan = tpplan.load(PLANS / "llama.yaml", ["mesh.tp=1", *sets])
    return load_corpora(plan.data, plan.eval, tmp_path / "run", vocab, seq_len)


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_llama):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_llama))


def test_text_is_packed_with_a_separator_and_windows_never_run_past_the_data(tmp_path, tiny_llama):
    """Documents end to end, the end-of-text token after each; windows are consecutive
    slices of that stream, each visited once an epoch; none holds a token that is not data
    (there is no padding), and the tail shorter than a window is left out."""
    from tokenizers import Tokenizer

    docs = tmp_path / "docs"
    docs.mkdir()
    texts = [" ".join(f"v{i}_{j} = {j * j + i}\n" for j in range(8 * i + 5)) for i in range(12)]
    for i, t in enumerate(texts):
        (docs / f"{i:02d}.py").write_text(t)
    c = corpora(tmp_path, f"data.path={docs}", f"data.tokenizer={tiny_llama / 'tokenizer.json'}",
                "data.separator=<|endoftext|>").train
    tok = Tokenizer.from_file(str(tiny_llama / "tokenizer.json"))
    sep = tok.token_to_id("<|endoftext|>")
    expected = []
    for t in texts:
        expected += tok.encode(t, add_special_tokens=False).ids + [sep]
    assert c.tokens.tolist() == expected and c.mask is None and c.packed
    n = c.windows(SEQ)
    assert n == (len(expected) - 1) // SEQ
    starts = []
    for step in range(1, n + 1):  # one epoch, a window a step
        (w,) = global_batch(c, 0, step, 1, SEQ).tolist()
        starts += [s for s in range(0, len(expected), SEQ) if expected[s:s + SEQ + 1] == w]
    assert sorted(starts) == list(range(0, n * SEQ, SEQ))  # every window once, in some order
    assert max(starts) + SEQ + 1 <= len(expected)  # never past the data: no padding to cross
    assert len(expected) - (max(starts) + SEQ + 1) < SEQ  # only a partial window left out
    pad = tok.token_to_id("<|im_end|>")  # the tokenizer's other special: never added by packing
    assert pad not in c.tokens.tolist()


def test_packed_batches_are_a_function_of_seed_step_and_dp_rank(tmp_path, tiny_llama):
    c = corpora(tmp_path, f"data.path={tiny_llama / 'chat.jsonl'}",
                f"data.tokenizer={tiny_llama}").train
    full = global_batch(c, 3, 7, 8, SEQ)
    for dp in (1, 2, 4):
        parts = [step_batch(c, 3, 7, 8, SEQ, r, dp) for r in range(dp)]
        assert torch.equal(torch.cat([p.tokens for p in parts]), full)
        assert torch.equal(torch.cat([p.tokens for p in parts]),
                           torch.cat([local_batch(c, 3, 7, 8, SEQ, r, dp) for r in range(dp)]))
        assert {p.count for p in parts} == {int(torch.cat([p.mask for p in parts]).sum())}
    assert not torch.equal(global_batch(c, 3, 8, 8, SEQ), full)
    assert not torch.equal(global_batch(c, 4, 7, 8, SEQ), full)


def test_chat_loss_mask_is_the_assistant_tokens_only(tmp_path, tiny_llama, hf_tokenizer):
    c = corpora(tmp_path, f"data.path={tiny_llama / 'chat.jsonl'}",
                f"data.tokenizer={tiny_llama}").train
    first = json.loads((tiny_llama / "chat.jsonl").read_text().splitlines()[0])["messages"]
    ids, mask = render_chat(hf_tokenizer, first, "chat.jsonl:1")
    n = len(ids)
    assert c.tokens[:n].tolist() == ids and c.mask[:n].tolist() == mask
    assert c.tokens[n] == hf_tokenizer.convert_tokens_to_ids("<|im_end|>") and not c.mask[n]
    answer = next(m["content"] for m in first if m["role"] == "assistant")
    assert hf_tokenizer.decode([i for i, m in zip(ids, mask) if m]) == answer + "<|im_end|>"
    assert 0 < int(c.mask.sum()) < len(c) // 2  # the prompts are most of it, and not learned


def test_templates_without_generation_markers_are_masked_by_prefixes(hf_tokenizer):
    """The same chats under the same template with its {% generation %} markers removed:
    the assistant turns are found by rendering prefixes, and agree with the markers' mask
    (plus the newline the template puts after each assistant turn)."""
    import copy

    plain = copy.copy(hf_tokenizer)
    plain.chat_template = hf_tokenizer.chat_template.replace("{% generation %}", "").replace(
        "{% endgeneration %}", "")
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4."}, {"role": "user", "content": "And 3+3?"},
            {"role": "assistant", "content": "6, twice three."}]
    ids, marked = render_chat(hf_tokenizer, chat, "x")
    ids2, found = render_chat(plain, chat, "x")
    assert ids == ids2
    newline = hf_tokenizer.encode("\n", add_special_tokens=False)
    extra = [i for i, (a, b) in enumerate(zip(marked, found)) if a != b]
    assert extra and all(found[i] and [ids[i]] == newline for i in extra)
    assert hf_tokenizer.decode([i for i, m in zip(ids, marked) if m]) == \
        "4.<|im_end|>6, twice three.<|im_end|>"


def test_token_cache_is_reused_and_remade_when_anything_changes(tmp_path, tiny_llama):
    data = tmp_path / "chat.jsonl"
    data.write_text((tiny_llama / "chat.jsonl").read_text())
    sets = [f"data.path={data}", f"data.tokenizer={tiny_llama}"]
    manifest = tmp_path / "run" / CACHE_DIR / "train.json"

    def made_at(*more: str) -> float:
        c = corpora(tmp_path, *sets, *more).train
        assert len(c) == json.loads(manifest.read_text())["tokens"]
        return json.loads(manifest.read_text())["made_at"]

    first = made_at()
    assert made_at() == first  # same sources, tokenizer and settings: mapped, not remade
    data.write_text(data.read_text().replace("Python", "Pyth0n", 1))
    second = made_at()
    assert second > first  # a source changed
    third = made_at("data.max_bytes=20000")
    assert third > second  # a setting changed
    assert made_at("data.max_bytes=20000") == third


def test_eval_fraction_holds_out_the_last_windows(tmp_path, tiny_llama):
    c = corpora(tmp_path, f"data.path={tiny_llama / 'chat.jsonl'}",
                f"data.tokenizer={tiny_llama}", "eval.fraction=0.1")
    whole = corpora(tmp_path, f"data.path={tiny_llama / 'chat.jsonl'}",
                    f"data.tokenizer={tiny_llama}").train
    n = whole.windows(SEQ)
    assert c.eval.windows(SEQ) == round(n * 0.1)
    assert c.train.windows(SEQ) + c.eval.windows(SEQ) == n
    cut = c.train.windows(SEQ) * SEQ
    assert torch.equal(c.eval.tokens, whole.tokens[cut:])
    assert torch.equal(c.eval.mask, whole.mask[cut:])


def _line(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return path


GOOD = json.dumps({"messages": [{"role": "user", "content": "hi"},
                                {"role": "assistant", "content": "hello"}]})


@pytest.mark.parametrize("lines, message", [
    ([GOOD, GOOD, '{"messages": [', GOOD], "bad.jsonl:3: not a JSON object"),
    ([GOOD, json.dumps({"messages": [{"role": "user", "content": "hi"}]})],
     "bad.jsonl:2: a chat without an assistant turn"),
    ([GOOD, json.dumps({"messages": [{"role": "user"}]})],
     "bad.jsonl:2: message 1 is not a {role, content} pair of strings"),
    ([json.dumps({"txt": "a"})], "bad.jsonl:1: no 'text' field (data.text_field; fields here: txt)"),
])
def test_bad_records_are_one_line_naming_file_and_line(tmp_path, tiny_llama, lines, message):
    path = _line(tmp_path, lines)
    with pytest.raises(DataError, match=".*" + message.replace("{", r"\{").replace("}", r"\}")
                       .replace("(", r"\(").replace(")", r"\)")):
        corpora(tmp_path, f"data.path={path}", f"data.tokenizer={tiny_llama}")


def test_bad_data_stops_train_before_it_starts_in_one_line(tmp_path, capsys, tiny_llama):
    """What a user sees: one ``error:`` line, no traceback, nothing trained."""
    path = _line(tmp_path, [GOOD, json.dumps({"messages": [{"role": "user", "content": "q"}]})])
    args = ["train", "--plan", PLANS / "llama.yaml", "--set", "mesh.tp=1", "--set",
            f"metrics.run_dir={tmp_path / 'run'}", "--set", f"data.tokenizer={tiny_llama}"]
    rc, out = run_main(capsys, *args, "--set", f"data.path={path}", "--set",
                       "model.kwargs.vocab_size=512")
    assert rc == 1 and out.strip() == f"error: {path}:2: a chat without an assistant turn " \
        "(the loss is taken on the assistant's tokens only; this chat would teach nothing)"
    rc, out = run_main(capsys, *args, "--set", f"data.path={tiny_llama / 'chat.jsonl'}",
                       "--set", "model.kwargs.vocab_size=256")
    assert rc == 1 and "Traceback" not in out, out
    assert out.splitlines()[0] == f"--set data.tokenizer={tiny_llama}:1:16: error: data.tokenizer " \
        f"{tiny_llama} has a vocabulary of 512 tokens, more than the model's 256: its ids past " \
        "255 have no embedding"
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_tokenizer_and_eval_keys_are_checked_where_they_stand(tmp_path):
    with pytest.raises(PlanErrors) as e:
        tpplan.load(PLANS / "llama.yaml", ["data.format=chats", "eval.fraction=1.5",
                                           "eval.path=x.jsonl"])
    text = str(e.value)
    assert "'data.format' must be one of auto, text, jsonl, parquet, chat, got 'chats' " \
        "(did you mean 'chat'?)" in text
    assert "'eval.fraction' must be between 0 and 1" in text
    assert "'eval' takes 'path' (a held-out file) or 'fraction'" in text
    with pytest.raises(PlanErrors, match="'data.format' needs 'data.tokenizer'"):
        tpplan.load(PLANS / "llama.yaml", ["data.format=chat"])
    with pytest.raises(PlanErrors, match="data.tokenizer 'nowhere' does not exist"):
        corpora(tmp_path, "data.tokenizer=nowhere", f"data.path={tmp_path}")


def test_parquet_records(tmp_path, tiny_llama):
    """With pyarrow: the text field of each row is a document. Without: one line saying
    which extra to install."""
    path = tmp_path / "t.parquet"
    sets = [f"data.path={path}", f"data.tokenizer={tiny_llama}"]
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        path.write_bytes(b"PAR1")
        with pytest.raises(DataError, match=r"t.parquet: reading .parquet needs pyarrow: "
                                            r"pip install 'tpplan\[parquet\]'"):
            corpora(tmp_path, *sets)
        return
    pq.write_table(pa.table({"text": ["def a(): pass\n" * 40, "x = 1\n" * 60]}), path)
    assert corpora(tmp_path, *sets).train.tokens.numel() > 40
