"""`mpt export`: checkpoints of `mpt train --model gpt-tiny / bert-tiny` become HF directories that
``from_pretrained`` loads and that compute our model's logits.

Three real `mpt train` runs (started together, 2 steps each, fp32) feed every test: gpt-tiny on
pp=2, the same on tp=2, and bert-tiny on pp=2 (whose tokenizer, trained by the run, ships along).
The reference is our `model_zoo` model holding the checkpoint's tensors, loaded here directly.
"""

import json
import os
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, BertForPreTraining

from model_zoo import bert, gpt
from mp_toolkit.checkpoint import open_checkpoint, save_checkpoint
from mp_toolkit.cli import main
from tests.cli_helpers import assert_one_line_exit_2
from tests.mpt_command import MptProcess

torch.set_num_threads(1)

RUN = ["--micro-batch", "2", "--microbatches", "2", "--seq-len", "16", "--steps", "2", "--lr", "1e-2",
       "--threads", "1", "--no-progress", "--timeout", "60"]
RUNS = {"gpt_pp2": ["--model", "gpt-tiny", "--data", "synthetic", "--pp", "2"],
        "gpt_tp2": ["--model", "gpt-tiny", "--data", "synthetic", "--pp", "1", "--tp", "2"],
        "bert_pp2": ["--model", "bert-tiny", "--data", "synthetic", "--pp", "2"]}
TIED = {"gpt": "lm_head.weight", "bert": "heads.predictions.decoder.weight"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{run name: its --save-dir}, the three runs trained at once (each starts its own 2 ranks)."""
    tmp = tmp_path_factory.mktemp("export_runs")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = {name: MptProcess(["train", *args, *RUN, "--save-dir", str(tmp / name), "--cache-dir", str(tmp / "cache")],
                              env=env, merge_stderr=True)
             for name, args in RUNS.items()}
    try:
        for name, p in procs.items():
            out, _ = p.communicate(timeout=240)
            assert p.returncode == 0, (name, out)
    finally:
        for p in procs.values():
            p.close()
    return {name: tmp / name for name in RUNS} | {"cache": tmp / "cache"}


def export(capsys, checkpoint, out, *flags) -> str:
    assert main(["export", "--checkpoint", str(checkpoint), "--out", str(out), *map(str, flags)]) == 0
    return capsys.readouterr().out


def zoo_model(root):
    """Our model from the recorded config, holding the checkpoint's tensors (the tie loads once)."""
    ck = open_checkpoint(root)
    family, cfg = ck.manifest["model"]["family"], ck.manifest["model"]["config"]
    model = (gpt.GPT(gpt.GPTConfig.from_dict(cfg)) if family == "gpt"
             else bert.BertForPreTraining(bert.BertConfig.from_dict(cfg)))
    state = {}
    for layer in ck.layer_names:
        state.update(ck.read_layer(layer))
    result = model.load_state_dict(state, strict=False)
    assert result.missing_keys == [TIED[family]] and not result.unexpected_keys, result
    return model.eval()


def gpt_inputs(vocab=256):
    return torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(1))


def test_gpt_pp2_export_loads_and_gives_our_logits(runs, capsys, tmp_path):
    line = export(capsys, runs["gpt_pp2"], tmp_path / "hf")
    assert "GPT2LMHeadModel" in line and "step 2" in line and "synthetic token ids" in line, line
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ours = zoo_model(runs["gpt_pp2"])
    assert type(hf).__name__ == "GPT2LMHeadModel" and hf.config.n_layer == 4 and hf.config.n_embd == 32
    # the Linear -> Conv1D transpose is exact, the tie survives the round trip
    assert torch.equal(hf.transformer.h[1].attn.c_attn.weight, ours.h[1].attn.qkv.weight.t())
    assert torch.equal(hf.transformer.h[3].mlp.c_proj.weight, ours.h[3].mlp.proj.weight.t())
    assert hf.lm_head.weight.data_ptr() == hf.transformer.wte.weight.data_ptr()
    ids = gpt_inputs()
    with torch.no_grad():
        want, got = ours(ids), hf(ids).logits
    assert got.shape == want.shape == (2, 16, 256)
    # HF's gelu_new is the tanh formula written out, ours F.gelu(approximate="tanh"): ~1e-7 apart
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def weight_noise_floor(hf_dir, diffs: dict, ids, logits, trials: int = 3) -> float:
    """Median relative change of ``logits`` when the model of ``hf_dir`` has each tensor moved by a
    random direction of the norm of its entry in ``diffs``."""
    g = torch.Generator().manual_seed(0)
    changes = []
    for _ in range(trials):
        model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
        state, moved = model.state_dict(), set()
        for k, d in diffs.items():
            if state[k].data_ptr() in moved:  # a tie: its second name is the same tensor, moved once
                continue
            moved.add(state[k].data_ptr())
            r = torch.randn(d.shape, generator=g)
            state[k].add_(r * (d.norm() / r.norm()))
        with torch.no_grad():
            changes.append(((model(ids).logits - logits).norm() / logits.norm()).item())
    return sorted(changes)[len(changes) // 2]


def test_tp2_checkpoint_exports_what_its_pp_equivalent_exports(runs, capsys, tmp_path):
    """Same training up to fp32 reduction order (invariant 1, bounded against float64 by the oracle
    tests); AdamW turns those ulps of near-zero gradients into up to ~1e-5 of weight, so the two
    exports' parameters agree to 1e-4 of the whole model's norm (measured 2e-6 to 2.9e-5, depending
    on the CPU's kernels and the initial weights). Their logits differ by what that weight
    difference does to the logits: the floor is measured here, as the logits' change when the pp=2
    model's tensors move by random directions of the same per-tensor norms (7e-5 of the logits'
    norm on an AMX Xeon, where the two exports differ by 1.2e-4: 1.6 floors); an export that
    computes another function is off by far more than 8 floors. What the export itself must keep
    exactly -- the tp=2 checkpoint's own model -- is compared tightly."""
    export(capsys, runs["gpt_tp2"], tmp_path / "tp2")
    export(capsys, runs["gpt_pp2"], tmp_path / "pp2")
    tp2 = AutoModelForCausalLM.from_pretrained(tmp_path / "tp2").eval()
    pp2 = AutoModelForCausalLM.from_pretrained(tmp_path / "pp2").eval()
    got, ref = tp2.state_dict(), pp2.state_dict()
    assert got.keys() == ref.keys() and all(got[k].shape == ref[k].shape for k in got)
    diff = torch.cat([(got[k] - ref[k]).flatten() for k in got]).norm()
    assert diff / torch.cat([ref[k].flatten() for k in got]).norm() < 1e-4
    ids = gpt_inputs()
    with torch.no_grad():
        got_logits, ref_logits = tp2(ids).logits, pp2(ids).logits
        floor = weight_noise_floor(tmp_path / "pp2", {k: got[k] - ref[k] for k in got}, ids, ref_logits)
        assert (got_logits - ref_logits).norm() / ref_logits.norm() < 8 * floor
        # and the tp=2 export is exactly its own checkpoint's model
        torch.testing.assert_close(tp2(ids).logits, zoo_model(runs["gpt_tp2"])(ids), atol=1e-5, rtol=0)


def test_bert_export_gives_mlm_and_nsp_logits_and_the_runs_tokenizer(runs, capsys, tmp_path):
    from tokenizers import Tokenizer

    from mp_toolkit.data.synthetic import synthetic_documents

    line = export(capsys, runs["bert_pp2"], tmp_path / "elsewhere")  # the run's cache is not the default one
    assert "no tokenizer: none with the run's digest" in line
    assert not (tmp_path / "elsewhere" / "tokenizer.json").exists()
    line = export(capsys, runs["bert_pp2"], tmp_path / "hf", "--cache-dir", runs["cache"])
    (prepared,) = runs["cache"].glob("prepared/*/tokenizer.json")  # the corpus the run prepared
    assert "BertForPreTraining" in line and f"tokenizer from {prepared}" in line, line
    hf = BertForPreTraining.from_pretrained(tmp_path / "hf").eval()
    ours = zoo_model(runs["bert_pp2"])
    assert hf.config.pad_token_id == ours.config.pad_token_id != 0  # the corpus's [PAD], not BERT's 0
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, ours.config.vocab_size, (2, 16), generator=g)
    types = torch.cat([torch.zeros(2, 8, dtype=torch.long), torch.ones(2, 8, dtype=torch.long)], dim=1)
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 11:] = 0  # the second sequence is padded
    with torch.no_grad():
        mlm, nsp = ours(ids, types, mask)
        out = hf(input_ids=ids, token_type_ids=types, attention_mask=mask)
    torch.testing.assert_close(out.prediction_logits, mlm, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.seq_relationship_logits, nsp, atol=1e-5, rtol=0)

    docs = synthetic_documents(open_checkpoint(runs["bert_pp2"]).manifest["config"]["seed"])  # the run's corpus
    run_tok = Tokenizer.from_file(str(prepared))
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = docs[3].splitlines()[0]
    assert tok(text, add_special_tokens=False)["input_ids"] == run_tok.encode(text, add_special_tokens=False).ids
    assert (tok.mask_token_id, tok.pad_token_id, tok.cls_token_id) == tuple(
        run_tok.token_to_id(t) for t in ("[MASK]", "[PAD]", "[CLS]"))
    assert tok.model_max_length == 64


def test_out_dir_not_empty_is_refused_unless_force(runs, capsys, tmp_path):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "stale.bin").write_text("old")
    assert_one_line_exit_2(capsys, ["export", "--checkpoint", runs["gpt_pp2"], "--out", out], "--force")
    assert (out / "stale.bin").read_text() == "old"
    export(capsys, runs["gpt_pp2"], out, "--force")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".hf.export-")]  # no scratch left behind
    # --force never deletes the checkpoint it reads
    assert_one_line_exit_2(capsys, ["export", "--checkpoint", runs["gpt_pp2"], "--out", runs["gpt_pp2"].parent,
                                    "--force"], "holds the checkpoint")


def test_missing_and_corrupt_checkpoints_are_refused(runs, capsys, tmp_path):
    assert_one_line_exit_2(capsys, ["export", "--checkpoint", tmp_path / "nope", "--out", tmp_path / "a"],
                           "does not exist")
    bad = tmp_path / "bad"
    shutil.copytree(runs["gpt_pp2"], bad)
    shard = bad / "step-00000002" / "layers" / "h.1.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x01  # one bit of one weight
    shard.write_bytes(bytes(data))
    assert_one_line_exit_2(capsys, ["export", "--checkpoint", bad, "--out", tmp_path / "b"], "SHA-256")
    assert not (tmp_path / "b").exists()


def test_zoo_checkpoint_refuses_a_config(runs, capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    assert_one_line_exit_2(capsys, ["export", "--checkpoint", runs["gpt_pp2"], "--out", tmp_path / "a",
                                    "--config", tmp_path / "config.json"], "without a config")


def save_zoo_checkpoint(root, model, tied: bool = True):
    """A checkpoint as mpt train writes one: per-layer full tensors, a tied head saved under the embedding."""
    layers = {name: {f"{name}.{k}": v for k, v in layer.state_dict().items()} for name, layer in model.named_layers()
              if not (tied and name == "lm_head")}
    spec = {"family": "gpt", "config": model.config.to_dict()}
    return save_checkpoint(root, 1, layers, manifest={"model": spec})


def test_untied_gpt_with_exact_gelu_and_n_inner_exports(capsys, tmp_path):
    torch.manual_seed(0)
    config = gpt.GPTConfig(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2, n_inner=24,
                           activation_function="gelu", tie_word_embeddings=False, layer_norm_epsilon=1e-6)
    ours = gpt.GPT(config).eval()
    save_zoo_checkpoint(tmp_path / "ck", ours, tied=False)
    export(capsys, tmp_path / "ck", tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert not hf.config.tie_word_embeddings and hf.lm_head.weight.data_ptr() != hf.transformer.wte.weight.data_ptr()
    assert torch.equal(hf.lm_head.weight, ours.lm_head.weight) and hf.config.n_inner == 24
    ids = gpt_inputs(64)
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids), atol=1e-5, rtol=0)


def test_a_gpt_hf_cannot_express_is_refused(capsys, tmp_path):
    """A bias-free GPT (GPTConfig(bias=False)): GPT2LMHeadModel always has biases."""
    model = gpt.GPT(gpt.GPTConfig(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2, bias=False))
    save_zoo_checkpoint(tmp_path / "ck", model)
    line = assert_one_line_exit_2(capsys, ["export", "--checkpoint", tmp_path / "ck", "--out", tmp_path / "hf"],
                                  "bias=False")
    assert "GPT2LMHeadModel" in line and not (tmp_path / "hf").exists()
    save_checkpoint(tmp_path / "plain", 1, {"embed": {"embed.w": torch.ones(2)}}, manifest={})  # no model, no hf_config
    assert_one_line_exit_2(capsys, ["export", "--checkpoint", tmp_path / "plain", "--out", tmp_path / "hf"],
                           "--config")


def test_hf_loaded_checkpoint_goes_through_its_hf_config_or_config_flag(capsys, tmp_path):
    """A checkpoint of an HF-loaded run (layers named by `from_hf`): its manifest's hf_config, or --config."""
    from tokenizers import Tokenizer, models
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    from mp_toolkit.checkpoint import split_by_layer
    from mp_toolkit.hf.adapters import from_hf
    from mp_toolkit.hf.common import layer_state_dict

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2)).eval()
    layers = from_hf(model)
    state = {k: t.detach() for k, t in layer_state_dict(layers).items() if k != "lm_head.weight"}  # tied to wte
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "cat": 1}, unk_token="[UNK]"))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(tmp_path / "tok")
    save_checkpoint(tmp_path / "ck", 1, split_by_layer(state, layers.names),
                    manifest={"hf_config": model.config.to_dict()})
    line = export(capsys, tmp_path / "ck", tmp_path / "hf", "--tokenizer", tmp_path / "tok")
    assert "GPT2LMHeadModel" in line and "tokenizer.json" in line, line
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (tmp_path / "tok" / "tokenizer.json").read_bytes()
    ids = gpt_inputs(64)
    with torch.no_grad():
        assert torch.equal(AutoModelForCausalLM.from_pretrained(tmp_path / "hf")(ids).logits, model(ids).logits)
    save_checkpoint(tmp_path / "bare", 1, split_by_layer(state, layers.names), manifest={})
    model.config.save_pretrained(tmp_path / "cfg")
    export(capsys, tmp_path / "bare", tmp_path / "hf2", "--config", tmp_path / "cfg" / "config.json")
    with torch.no_grad():
        assert torch.equal(AutoModelForCausalLM.from_pretrained(tmp_path / "hf2")(ids).logits, model(ids).logits)


def test_sharded_export_matches_save_pretrained_and_reads_one_layer_at_a_time(runs, capsys, tmp_path, monkeypatch):
    """Above --max-shard-size the weights are split as ``save_pretrained`` splits them (numbered
    shards + index); the directory holds the same keys, tensors and config as HF's own
    ``save_pretrained`` of the loaded model, and the export never holds two layers at once: every
    tensor a layer read returned is gone before the next layer is read."""
    import gc
    import weakref

    from mp_toolkit.checkpoint.reader import Checkpoint

    alive, overlaps, read = weakref.WeakSet(), [], Checkpoint.read_layer

    def watched(self, name):
        gc.collect()
        overlaps.append(len(alive))
        tensors = read(self, name)
        alive.update(tensors.values())
        return tensors

    monkeypatch.setattr(Checkpoint, "read_layer", watched)
    export(capsys, runs["gpt_pp2"], tmp_path / "sharded", "--max-shard-size", "20kB")
    monkeypatch.setattr(Checkpoint, "read_layer", read)
    assert len(overlaps) == len(open_checkpoint(runs["gpt_pp2"]).layer_names) and not any(overlaps), overlaps
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors", shards
    assert not (tmp_path / "sharded" / "model.safetensors").exists()

    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "sharded").eval()
    hf.save_pretrained(tmp_path / "reference")  # HF's own writer of the same model: one file
    from safetensors.torch import load_file

    ours = {}
    for shard in shards:
        part = load_file(tmp_path / "sharded" / shard)
        assert all(index["weight_map"][k] == shard for k in part)
        ours.update(part)
    theirs = load_file(tmp_path / "reference" / "model.safetensors")
    assert ours.keys() == theirs.keys() and "lm_head.weight" not in ours  # the tie written once, as HF does
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in ours.values())
    read_json = lambda d, name: {k: v for k, v in json.loads((d / name).read_text()).items()  # noqa: E731
                                 if k != "transformers_version"}
    for name in ("config.json", "generation_config.json"):
        assert read_json(tmp_path / "sharded", name) == read_json(tmp_path / "reference", name), name
    single = tmp_path / "single"
    export(capsys, runs["gpt_pp2"], single)
    assert sorted(p.name for p in single.iterdir() if p.suffix == ".safetensors") == ["model.safetensors"]
    assert load_file(single / "model.safetensors").keys() == ours.keys()


def test_bad_max_shard_size_is_one_line(runs, capsys, tmp_path):
    assert_one_line_exit_2(capsys, ["export", "--checkpoint", str(runs["gpt_pp2"]), "--out", str(tmp_path / "o"),
                                    "--max-shard-size", "lots"], "--max-shard-size")
    assert not (tmp_path / "o").exists()
