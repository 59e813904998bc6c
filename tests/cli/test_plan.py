"""`k3 plan`: totals against docs/checkpoint.md §12, docs/model.md §13, the official tensor list and shard table, errors
(exit 2)."""

import contextlib
import csv
import gzip
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from k3jax.cli.main import main
from k3jax.config import get_preset
from k3jax.model import abstract_params, count_params

REPO = Path(__file__).resolve().parents[2]
TINY_PARAMS = 302_438  # k3-tiny: the closed-form count the removed config.param_count_estimate gave, pinned


# the release's tensor list and shard table, copied into the repo (tests/golden/k3/README.md); else a sibling ../shared
GOLDEN = next((d for d in (REPO / "tests/golden/k3", REPO.parent / "shared/k3") if (d / "shards.tsv").exists()), None)
needs_golden = pytest.mark.skipif(GOLDEN is None, reason="k3 data not found in tests/golden/k3/ nor ../shared/k3/")


def run_json(capsys, *argv):
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def k3_plan():
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["plan", "--preset", "kimi-k3", "--json", "--context", "131072", "--hardware", "8xB300",
                   "--hardware", "16xB200", "--hardware", "64xH200"])
    assert rc == 0
    return json.loads(buf.getvalue())


def test_kimi_k3_totals_via_cli(k3_plan):
    p = k3_plan
    # docs/checkpoint.md §12.1: 2,779,484,478,208 with the A_log pad; 2,779,484,476,000 without. total_params is the
    # k3jax tree (A_log [96]); checkpoint_params counts the stored tensors (A_log [128]).
    assert p["total_params"] == 2_779_484_476_000
    assert p["checkpoint_params"] == 2_779_484_478_208
    assert abs(p["total_params"] / 2.7795e12 - 1) < 5e-4
    # docs/checkpoint.md §12.1: 104,189,532,416 counts A_log as 128 per KDA layer; the tree has 96 → 69 * 32 fewer
    assert p["active_params"] == 104_189_532_416 - 69 * 32
    assert abs(p["active_params"] / 104.19e9 - 1) < 1e-3
    assert p["active_params_with_embedding"] - p["active_params"] == 1_174_405_120
    assert p["checkpoint_bytes"] == 1_559_965_606_912
    assert p["routed_expert_bytes"] == 1_446_456_066_048
    assert p["checkpoint_tensors"] == 497_052
    assert p["bytes_by_dtype"] == {"BF16": 113_465_051_136, "F32": 44_489_728, "U8": 1_446_456_066_048}


def test_kimi_k3_breakdown(k3_plan):
    c = {k: v["params"] for k, v in k3_plan["components"].items()}
    assert c["routed_experts"] == 2_722_740_830_208
    assert c["shared_experts"] == 12_155_092_992
    assert c["latent_proj"] == 4_727_310_336
    assert c["router"] + c["router_bias"] == 590_955_008
    assert c["mla_attention"] == 5_572_706_304
    assert c["kda_attention"] == 30_618_088_704 - 69 * 32
    assert c["dense_mlp"] == 726_663_168
    assert c["norms_and_attn_res"] == 4_021_248
    assert k3_plan["components"]["routed_experts"]["active"] == 48_620_371_968
    assert k3_plan["components"]["router"]["active"] == 590_872_576
    assert k3_plan["components"]["router_bias"]["active"] == 0
    layers = k3_plan["layers"]
    assert len(layers) == 93
    assert [l["layer"] for l in layers if l["attention"] == "mla"] == [*range(3, 91, 4), 91, 92]
    assert [l["ffn"] for l in layers[:2]] == ["dense", "moe"]
    # per-layer bytes are the shard payloads (shards.tsv): layer 0, KDA+MoE, MLA+MoE
    assert (layers[0]["bytes"], layers[1]["bytes"], layers[3]["bytes"]) == (2_341_213_184, 16_990_092_800,
                                                                           16_566_684_160)
    assert layers[1]["params"] == 443_740_416 - 32 + 896 * 33_030_144 + 189_927_808 + 43_008
    assert layers[1]["active"] == 443_740_416 - 32 + 16 * 33_030_144 + 189_927_808 - 896 + 43_008
    assert k3_plan["model_level"]["bytes"] == 4_697_663_488
    assert sum(l["params"] for l in layers) + k3_plan["model_level"]["params"] == k3_plan["total_params"]


def test_kimi_k3_memory(k3_plan):
    mem = k3_plan["memory"]
    page = 17_547_264  # one MXFP4 expert (docs/numerics.md §10.4)
    replicated = 113_509_540_864  # non-expert text bytes (docs/checkpoint.md §12.2)
    assert mem["replicated_weight_bytes"] == replicated
    assert mem["kda_state_bytes_per_sequence"] == 69 * 96 * 128 * 128 * 4
    assert mem["mla_cache_bytes_per_token"] == 24 * (512 + 64) * 2
    by = {m["mesh"]: m for m in mem["meshes"]}
    for name, n, cap in (("8xB300", 8, 288e9), ("16xB200", 16, 192e9), ("64xH200", 64, 141e9)):
        m = by[name]
        assert m["devices"] == n and m["device_bytes"] == cap
        assert m["weights_bytes"] == replicated + 92 * -(-896 // n) * page
        assert m["mla_cache_bytes"] == 131072 * 24 * 576 * 2
        assert m["total_bytes"] == m["weights_bytes"] + m["kda_state_bytes"] + m["mla_cache_bytes"]
        assert m["fits"] == (m["total_bytes"] <= cap)
    assert by["64xH200"]["fits"] and not by["8xB300"]["fits"]
    assert any("replicated" in a for a in mem["assumptions"])


@pytest.mark.parametrize("preset", ["kimi-k3", "k3-mini"])
def test_cache_per_sequence_at_1m_tokens(capsys, preset):
    """The 2^20-token per-sequence totals against a closed form from the config fields: fp32 KDA state [H, K, K] and
    conv windows [3, W-1, H K] per KDA layer (fixed), bf16 MLA values per token per MLA layer."""
    cfg = get_preset(preset)
    p = run_json(capsys, "--preset", preset, "--hardware", "8xH200")
    mem = p["memory"]
    n = 1_048_576
    kda = cfg.num_kda_layers * (cfg.kda_num_heads * cfg.kda_head_dim**2 * 4
                                + 3 * (cfg.kda_conv_size - 1) * cfg.kda_num_heads * cfg.kda_head_dim * 4)
    latent = cfg.num_mla_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2
    plain = cfg.num_mla_layers * cfg.mla_num_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
                                                      + cfg.v_head_dim) * 2
    assert mem["context_1m"] == n and mem["mla_cache_dtype"] == "bfloat16"
    assert mem["cache_bytes_per_sequence_at_1m"] == kda + n * latent
    assert mem["plain_kv_cache_bytes_per_token"] == plain
    assert mem["plain_kv_cache_bytes_per_sequence_at_1m"] == kda + n * plain
    assert mem["plain_kv_over_latent_cache_at_1m"] == pytest.approx((kda + n * plain) / (kda + n * latent))
    if preset == "kimi-k3":  # by hand: 69 KDA layers, 96 heads of 128; 24 MLA layers, R 512, rope 64, N 96
        assert kda == 434_110_464 + 30_523_392
        assert mem["cache_bytes_per_sequence_at_1m"] == 29_455_663_104  # 27,648 B/token
        assert mem["plain_kv_cache_bytes_per_sequence_at_1m"] == 1_546_652_860_416  # 1,474,560 B/token
        assert round(mem["plain_kv_over_latent_cache_at_1m"], 2) == 52.51
    assert main(["plan", "--preset", preset, "--hardware", "8xH200"]) == 0
    text = capsys.readouterr().out
    assert "cache per sequence at 1,048,576 tokens" in text and "plain KV" in text


def test_batch_and_context_scale_the_caches(capsys):
    p = run_json(capsys, "--preset", "k3-mini", "--hardware", "8xH200", "--context", "1000", "--batch", "20")
    m = p["memory"]["meshes"][0]
    assert m["sequences_per_device"] == 3
    assert m["mla_cache_bytes"] == 3 * 1000 * p["memory"]["mla_cache_bytes_per_token"]
    assert m["kda_state_bytes"] == 3 * (p["memory"]["kda_state_bytes_per_sequence"]
                                        + p["memory"]["kda_conv_bytes_per_sequence"])


def test_kimi_linear_48b(capsys):
    p = run_json(capsys, "--preset", "kimi-linear-48b")
    assert abs(p["total_params"] / 49.12e9 - 1) < 1e-3  # docs/model.md §13
    assert abs(p["active_params"] / 3.11e9 - 1) < 5e-3
    assert abs(p["active_params_with_embedding"] / 3.48e9 - 1) < 5e-3
    assert p["layout"] == "kimi-linear" and p["expert_format"] == "bf16"
    assert p["checkpoint_params"] == p["total_params"]  # A_log stored [1, 1, H, 1]: no pad
    assert p["checkpoint_bytes"] == 2 * p["total_params"] + 2 * 20 * (32 + 4096) + 2 * 26 * 256  # F32 extras


def test_tiny_presets_plan(capsys):
    p = run_json(capsys, "--preset", "k3-tiny")
    assert p["expert_format"] == "mxfp4"
    assert p["total_params"] == count_params(abstract_params(get_preset("k3-tiny"))) == TINY_PARAMS
    assert main(["plan", "--preset", "k3-mini"]) == 0
    out = capsys.readouterr().out
    assert "total params" in out and "35,900,644" in out and "64xH200" in out


def test_listings_small_preset(capsys):
    rows = json.loads(_capture(capsys, "--preset", "k3-mini", "--tensors", "--json"))
    assert len(rows) == 1770 and len({r["name"] for r in rows}) == 1770
    assert rows[-1] == {"name": "language_model.model.output_attn_res_proj.weight", "dtype": "BF16",
                        "shape": [1, 384]}
    tsv = _capture(capsys, "--preset", "k3-mini", "--shards").splitlines()
    assert tsv[0].split("\t") == ["file", "bytes", "header_len", "header_sha256", "tensors"]
    assert [r.split("\t")[0] for r in tsv[1:]] == [f"model-{k:05d}-of-000010.safetensors" for k in range(1, 11)]
    assert sum(int(r.split("\t")[4]) for r in tsv[1:]) == 1770


@needs_golden
def test_tensors_listing_equals_official(capsys):
    assert main(["plan", "--preset", "kimi-k3", "--tensors"]) == 0
    out = capsys.readouterr().out
    with gzip.open(GOLDEN / "tensors.tsv.gz", "rt") as f:
        want = f.read()
    assert out == want  # same rows, same order, same header line


@needs_golden
def test_shards_json_equals_published(capsys):
    with open(GOLDEN / "shards.tsv") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    got = json.loads(_capture(capsys, "--preset", "kimi-k3", "--shards", "--json"))
    assert len(got) == 94
    for g, r in zip(got, rows):
        assert g["file"] == r["file"]
        assert g["bytes"] == int(r["file_bytes_published"])
        assert g["header_len"] == int(r["header_json_len_N"])
        assert g["header_sha256"] == r["header_sha256_computed"]
    pinned = {int(r["shard"]): r["header_sha256_computed"] for r in rows if r["header_sha256_independently_pinned"]
              == "yes"}
    assert {k: got[k - 1]["header_sha256"] for k in (1, 2, 4, 94)} == {k: pinned[k] for k in (1, 2, 4, 94)}


def _capture(capsys, *argv) -> str:
    assert main(["plan", *argv]) == 0
    return capsys.readouterr().out


def test_mesh_of_hardware_is_a_deprecated_alias(capsys):
    """docs/cli.md: `--mesh` never means hardware; the old `--mesh 8xB300` is read as --hardware for one
    release, with a warning naming the new spelling."""
    assert main(["plan", "--preset", "k3-mini", "--mesh", "8xH200", "--json"]) == 0
    cap = capsys.readouterr()
    assert "use --hardware 8xH200" in cap.err
    old = json.loads(cap.out)["memory"]["meshes"]
    assert old == run_json(capsys, "--preset", "k3-mini", "--hardware", "8xH200")["memory"]["meshes"]


@pytest.mark.parametrize("argv,msg", [
    (["--preset", "kimi-k9"], "known presets: k3-micro, k3-mini, k3-tiny, kimi-k3, kimi-linear-48b, kimi-linear-tiny"),
    (["--preset", "k3-tiny", "--hardware", "8xTPU"], "known hardware: 8xB300, 16xB200"),
    (["--preset", "k3-tiny", "--mesh", "expert=8"], "mesh axes are for --compile"),
    (["--preset", "k3-tiny", "--target", "cpu:8"], "--target applies to --compile"),
    (["--preset", "k3-tiny", "--mode", "train"], "--mode applies to --compile"),
    (["--preset", "k3-tiny", "--batch", "0"], "--batch"),
])
def test_bad_input_exits_2(capsys, argv, msg):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert msg in err


def test_console_script_subprocess():
    exe = Path(sys.executable).parent / "k3"
    if not exe.exists():
        pytest.skip(f"console script {exe} not installed")
    r = subprocess.run([str(exe), "plan", "--preset", "k3-tiny", "--json"], capture_output=True, text=True,
                       timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["total_params"] == TINY_PARAMS
    r = subprocess.run([str(exe), "plan", "--preset", "nope"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "known presets" in r.stderr
