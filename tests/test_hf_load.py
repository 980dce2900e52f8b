"""`mpt train --hf DIR` loads per stage: each rank reads only its own layers' tensors from DIR's
safetensors (tensor-parallel shards as slices), never the whole model (DESIGN.md invariant 9).

Tiny random GPT-2, Llama (grouped-query: 2 k/v heads for 4 q heads) and BERT are saved with
save_pretrained into tmp dirs, and each also as a sharded checkpoint written here: its
model.safetensors split into two files (the first half of the tensors in model order, then the
rest) plus the model.safetensors.index.json that names them. What the ranks load is compared
bitwise with ``from_pretrained(DIR, dtype=torch.float32)``, sharded with `shard_full`.
"""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mp_toolkit.hf.adapters import from_hf
from mp_toolkit.hf.common import layer_state_dict
from mp_toolkit.parallel.layouts import pad_dim
from mp_toolkit.parallel.tensor_parallel import shard_full
from mp_toolkit.run.config import ConfigError
from tests.cli_helpers import assert_one_line_exit_2
from tests.dist_harness import run_world
from tests.hf_workers import tiny_hf
from tests.mpt_command import run_mpt

SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
TRAIN = ["train", "--microbatches", "2", "--micro-batch", "2", "--seq-len", "16", "--data", "synthetic", "--threads",
         "1", "--no-progress"]


def save(path: Path, name: str, dtype=torch.float32) -> Path:
    import transformers

    transformers.utils.logging.disable_progress_bar()
    tiny_hf(name, seed=3).to(dtype).save_pretrained(path)
    return path


def shard(src: Path, dst: Path) -> Path:
    """``src`` with its model.safetensors split in two shards and an index naming them."""
    shutil.copytree(src, dst)
    (dst / "model.safetensors").unlink()
    with safe_open(src / "model.safetensors", "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    order = [k for k in reference(src).state_dict() if k in tensors]  # model order: embeddings, blocks, head
    file_of = {k: SHARDS[i >= len(order) // 2] for i, k in enumerate(order)}
    for file in SHARDS:
        save_file({k: tensors[k] for k in order if file_of[k] == file}, dst / file, metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": file_of}))
    return dst


def reference(directory: Path) -> torch.nn.Module:
    import transformers

    config = json.loads((directory / "config.json").read_text())
    return getattr(transformers, config["architectures"][0]).from_pretrained(directory, dtype=torch.float32)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """{name: (single-file directory, sharded directory)} for gpt2, llama and bert-pretraining."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for name in ("gpt2", "llama", "bert-pretraining"):
        single = save(root / name, name)
        out[name] = (single, shard(single, root / f"{name}-sharded"))
    return out


# --- the ranks: build on meta, split, materialise their own stage -------------------------------

def load_rank(rank, world, directories, pp, tp):
    """For each directory: this rank's layers as `mpt train` makes them (`compose.own_layers`), with
    a log of every tensor read. Returns per directory (held shares with their layouts, buffers of the
    kept layers, names of real parameters outside them, meta parameter count, reads, files opened)."""
    from mp_toolkit.hf import weights
    from mp_toolkit.hf.weights import SafetensorsFiles
    from mp_toolkit.layers import LayerList
    from mp_toolkit.parallel.context import build_context
    from mp_toolkit.parallel.materialize import rank_layers
    from mp_toolkit.run.compose import own_layers
    from mp_toolkit.run.families import resolve_hf
    from mp_toolkit.run.hf_family import hf_tensor_parallel

    reads, plain_read, opened, plain_open = [], SafetensorsFiles.read, set(), weights.safe_open

    def logged_read(self, name, dim=0, ranges=None):
        t = plain_read(self, name, dim, ranges)
        reads.append((name, ranges is not None, t.numel()))
        return t

    def logged_open(file, framework):
        opened.add(Path(file).name)
        return plain_open(file, framework)

    SafetensorsFiles.read = logged_read
    weights.safe_open = logged_open
    ctx = build_context(pp, tp)
    out = []
    for directory in directories:
        reads.clear()
        opened.clear()
        model = resolve_hf(str(directory)).build()
        layers = hf_tensor_parallel(LayerList.from_model(model), ctx)
        assert all(p.is_meta for p in layers.parameters())  # split on meta: shapes only
        boundaries = [0, len(layers) // 2, len(layers)] if pp == 2 else [0, len(layers)]
        keep = rank_layers(boundaries, [ctx.pp_rank])
        own_layers(model, layers, keep, ctx)
        held, buffers, real_elsewhere, n_meta, unique = {}, {}, [], 0, {}
        for i, (lname, layer) in enumerate(zip(layers.names, layers.layers)):
            for path, p in layer.named_parameters():
                if i in keep:
                    layout = ((p.partition_dim, p.partition_stride, getattr(p, "unpadded_size", None))
                              if getattr(p, "tensor_model_parallel", False) else None)
                    held[f"{lname}.{path}"] = (p.detach().clone(), layout)
                    unique[id(p)] = p.numel()  # a tied weight held twice is one Parameter, read once
                    if getattr(p, "unpadded_size", None) is not None:  # a padded vocabulary is read whole
                        unique[id(p)] = p.numel() // p.shape[p.partition_dim] * p.unpadded_size
                elif p.is_meta:
                    n_meta += 1
                else:
                    real_elsewhere.append(f"{lname}.{path}")
            if i in keep:
                buffers.update({f"{lname}.{path}": b.clone() for path, b in layer.named_buffers()})
        out.append((held, buffers, real_elsewhere, n_meta, sum(unique.values()), list(reads), sorted(opened),
                    model.weights.files.file_of))
    return ctx.pp_rank, ctx.tp_rank, out


def expected(directory):
    """(every parameter and buffer of from_pretrained's layer list by our name, HF names by our name)."""
    from mp_toolkit.hf.adapters import hf_name_map

    model = reference(directory)
    layers = from_hf(model)
    state = layer_state_dict(layers)
    buffers = {f"{n}.{path}": b for n, layer in zip(layers.names, layers.layers) for path, b in layer.named_buffers()}
    return state, buffers, hf_name_map(model)


def check_world(name, dirs, pp, tp):
    single, sharded = dirs[name]
    state, want_buffers, hf_names = expected(single)
    results = run_world(load_rank, pp * tp, [single, sharded], pp, tp, timeout_s=300)
    for pp_rank, tp_rank, per_dir in results:
        for directory, (held, buffers, real_elsewhere, n_meta, n_held, reads, opened, file_of) in zip(
                (single, sharded), per_dir):
            where = f"{name} {directory.name} pp_rank {pp_rank} tp_rank {tp_rank}"
            assert held and (n_meta > 0) == (pp > 1) and real_elsewhere == [], where  # others' stay on meta
            for key, (t, layout) in held.items():  # bitwise from_pretrained's (this rank's shard of it)
                full = state[key]
                if layout is not None and layout[2] is not None:  # a vocabulary padded for tp: zero rows
                    full = pad_dim(full, layout[0], t.shape[layout[0]] * tp)
                want = full if layout is None else shard_full(full, layout[:2], tp_rank, tp)
                assert t.dtype == torch.float32 and torch.equal(t, want), (where, key)
                if tp > 1 and layout is not None:
                    assert t.numel() * tp == full.numel(), (where, key)  # a shard, not the whole
            assert all(torch.equal(b, want_buffers[k]) for k, b in buffers.items()), where  # rotary inv_freq, ...
            # Read: exactly this rank's shares, each once, tp shards as slices (a vocabulary padded for
            # tp: its real rows whole, then padded and cut); only the files holding them
            assert sum(n for _, _, n in reads) == n_held, where
            own_hf = {hf for key in held for hf in hf_names[key]}
            assert {r for r, _, _ in reads} <= own_hf, where
            sliced = [r for r, as_slices, _ in reads if as_slices]
            assert (len(sliced) > 0) == (tp > 1), where
            assert opened == sorted({Path(file_of[r]).name for r, _, _ in reads}), where
    return results


def test_gpt2_pp2_and_tp2_load_their_own_parts_bitwise(dirs):
    """GPT-2's tied lm_head is read from transformer.wte.weight (the file has no lm_head.weight):
    on pp=2 rank 1 reads it for its head, on tp=2 each rank its vocab rows; c_attn's fused
    [q | k | v] columns are read as three slices (stride 3)."""
    for pp_rank, _, per_dir in check_world("gpt2", dirs, pp=2, tp=1):
        reads = {r for r, _, _ in per_dir[1][5]}
        assert "transformer.wte.weight" in reads  # rank 0 for its embedding, rank 1 for its tied head
        assert ("transformer.h.0.ln_1.weight" in reads) == (pp_rank == 0)
    for _, _, per_dir in check_world("gpt2", dirs, pp=1, tp=2):
        held = per_dir[0][0]
        assert held["h.0.block.attn.c_attn.weight"][0].shape == (32, 48)
        assert held["lm_head.weight"][0].shape == (128, 32)  # vocab 128 padded to 256 (a multiple of 128 x tp)


def test_llama_gqa_pp2_and_tp2_load_their_own_parts_bitwise(dirs):
    """Untied Llama: on pp=2 each rank opens only the shard of its half (rank 0 the first, rank 1
    the second); on tp=2 the 2 k/v heads split one per rank."""
    for pp_rank, _, per_dir in check_world("llama", dirs, pp=2, tp=1):
        assert per_dir[0][6] == ["model.safetensors"] and per_dir[1][6] == [SHARDS[pp_rank]]
        assert "layers.1.rotary_emb.inv_freq" in per_dir[0][1] or pp_rank == 1  # real, from __init__
    for _, _, per_dir in check_world("llama", dirs, pp=1, tp=2):
        assert per_dir[0][0]["layers.0.block.self_attn.k_proj.weight"][0].shape == (8, 32)


def test_bert_pp2_loads_its_own_half_bitwise(dirs):
    """BERT at pp=2 (its tensor-parallel plan is tested in tests/test_hf.py): the MLM decoder on stage 1 is tied to
    the word embedding of stage 0, and its bias to cls.predictions.bias; both are read from the file's names."""
    for pp_rank, _, per_dir in check_world("bert-pretraining", dirs, pp=2, tp=1):
        reads = {r for r, _, _ in per_dir[0][5]}
        assert "bert.embeddings.word_embeddings.weight" in reads  # rank 1: for the tied decoder
        assert ("cls.predictions.bias" in reads) == (pp_rank == 1)


def test_bf16_sharded_checkpoint_loads_as_from_pretrained_fp32(tmp_path):
    """A bf16 checkpoint (as most are published) in two shards: read per tensor and cast, the same
    fp32 values from_pretrained(dtype=torch.float32) gives. Single process, every layer kept."""
    from mp_toolkit.layers import LayerList
    from mp_toolkit.parallel.context import build_context
    from mp_toolkit.run.compose import own_layers
    from mp_toolkit.run.families import resolve_hf

    d = shard(save(tmp_path / "bf16", "llama", torch.bfloat16), tmp_path / "bf16-sharded")
    model = resolve_hf(str(d)).build()
    layers = LayerList.from_model(model)
    own_layers(model, layers, list(range(len(layers))), build_context(1))
    got, (want, _, _) = layer_state_dict(layers), expected(tmp_path / "bf16")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert want["layers.0.block.mlp.up_proj.weight"].dtype == torch.float32


def test_mpt_train_from_the_shards_on_pp2_and_under_deepspeed_equals_the_single_file(dirs, tmp_path):
    """The CLI path, GPT-2 (wte / lm_head tied across the two stages): read from its two shards by two
    stages, it trains as when one process reads model.safetensors: the first loss (before any step)
    bitwise, the rest to tests/test_hf_train.py's tied-head 1e-6 (the tied gradient is summed in
    another order). --engine deepspeed too: its TiedLayers hold every member of a tie group on each
    stage that has one (the last stage holds the embedding layer), so those are read as well."""
    single, sharded = dirs["gpt2"]
    one = train_losses(tmp_path, "one", "--hf", single, "--pp", "1")
    two = train_losses(tmp_path, "two", "--hf", sharded, "--pp", "2")
    ds = train_losses(tmp_path, "ds", "--hf", sharded, "--pp", "2", "--engine", "deepspeed", DS_ACCELERATOR="cpu")
    assert len(one) == 3 and two[0] == one[0] and two == pytest.approx(one, rel=1e-6)
    assert ds == pytest.approx(two, rel=1e-6)


def train_losses(tmp_path, tag, *args, **env):
    """The per-step losses of a 3-step `mpt train` that must succeed."""
    metrics = tmp_path / f"{tag}.jsonl"
    r = run_mpt([*TRAIN, "--steps", "3", "--lr", "1e-2", "--timeout", "60", "--metrics", metrics,
                 "--cache-dir", tmp_path / "cache", *args],
                timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1", **env))
    assert r.returncode == 0, r.stdout + r.stderr
    return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]


# --- bad input: one line naming the file and the tensor, exit 2, before any rank starts ----------

ARGS = [*TRAIN, "--steps", "1", "--pp", "2"]


def test_a_missing_shard_a_wrong_shape_and_a_truncated_shard_are_one_line_exit_2(capsys, dirs, tmp_path):
    src = dirs["llama"][1]
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    second = next(k for k, f in index.items() if f == SHARDS[1])

    missing = Path(shutil.copytree(src, tmp_path / "missing"))
    (missing / SHARDS[1]).unlink()
    assert_one_line_exit_2(capsys, [*ARGS, "--hf", missing],
                           mentions=f"places tensor {second} in {SHARDS[1]}, but {missing} has no such file")

    pickled = Path(shutil.copytree(src, tmp_path / "pickled"))  # an index naming a .bin shard is refused
    (pickled / SHARDS[1]).rename(pickled / "pytorch_model-00002-of-00002.bin")
    doc = json.loads((pickled / "model.safetensors.index.json").read_text())
    doc["weight_map"] = {k: ("pytorch_model-00002-of-00002.bin" if f == SHARDS[1] else f) for k, f in index.items()}
    (pickled / "model.safetensors.index.json").write_text(json.dumps(doc))
    assert_one_line_exit_2(capsys, [*ARGS, "--hf", pickled], mentions="only .safetensors files of")

    truncated = Path(shutil.copytree(src, tmp_path / "truncated"))
    data = (truncated / SHARDS[1]).read_bytes()
    (truncated / SHARDS[1]).write_bytes(data[:-100])
    line = assert_one_line_exit_2(capsys, [*ARGS, "--hf", truncated], mentions=f"{truncated / SHARDS[1]} is truncated")
    n = int.from_bytes(data[:8], "little")
    ends = {k: e["data_offsets"][1] for k, e in json.loads(data[8:8 + n]).items() if k != "__metadata__"}
    first_cut = min((end, k) for k, end in ends.items() if end > len(data) - 100 - 8 - n)[1]
    assert f"tensor {first_cut} ends at byte" in line

    wrong = Path(shutil.copytree(dirs["gpt2"][0], tmp_path / "wrong"))
    with safe_open(wrong / "model.safetensors", "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors["transformer.h.1.mlp.c_fc.weight"] = tensors["transformer.h.1.mlp.c_fc.weight"][:, :100].contiguous()
    save_file(tensors, wrong / "model.safetensors", metadata={"format": "pt"})
    assert_one_line_exit_2(capsys, [*ARGS, "--hf", wrong],
                           mentions=f"{wrong / 'model.safetensors'}: tensor transformer.h.1.mlp.c_fc.weight has "
                                    "shape (32, 100) but config.json makes it (32, 128)")

    del tensors["transformer.h.1.mlp.c_fc.weight"]  # from_pretrained would draw it at random: refused
    save_file(tensors, wrong / "model.safetensors", metadata={"format": "pt"})
    assert_one_line_exit_2(capsys, [*ARGS, "--hf", wrong],
                           mentions="has no tensor transformer.h.1.mlp.c_fc.weight: from_pretrained would initialise")


def test_a_shard_damaged_after_the_check_fails_the_read_in_one_line(dirs, tmp_path):
    """On a rank (the file changed after validation): the read's error names the file and the tensor."""
    from mp_toolkit.run.families import resolve_hf

    d = Path(shutil.copytree(dirs["llama"][1], tmp_path / "late"))
    model = resolve_hf(str(d)).build()
    model.weights.check()  # headers read and cached, as before any rank starts
    (d / SHARDS[1]).write_bytes((d / SHARDS[1]).read_bytes()[:-100])
    model.initial_value("embed_tokens.embed_tokens.weight")  # in the intact first shard
    with pytest.raises(ConfigError, match=rf"--hf {d}: {d / SHARDS[1]}: cannot read tensor model.norm.weight"):
        model.initial_value("norm.norm.weight")
