"""Ablation files: the one-factor guarantee and every bad input exit 2 before any training, naming the key; the
shipped specs resolve (k3-mini, shapes only) with the declared differences and nothing else."""

import glob
import os

import pytest

from k3jax.ablate.resolve import format_diff, load_spec
from k3jax.ablate.runner import claim_out
from k3jax.ablate.spec import FACTORS, AblationSpecError
from k3jax.cli.main import main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# the smoke's 2-layer k3-tiny base, 2 steps: resolving it takes well under a second
HEAD = """
seeds = 2
[base]
preset = "k3-tiny"
model = { num_layers = 2, full_attn_layers = [2], attn_res_block_size = 1 }
train = { batch = 4, seq_len = 32 }
[budget]
tokens = 256
[data]
max_bytes = 100000
[eval]
windows = 4
"""


def _write(tmp_path, body, head=HEAD, name="spec.toml"):
    p = tmp_path / name
    p.write_text(head + body)
    return str(p)


def _refused(capsys, path, *needles):
    """`k3 ablate FILE --check` exits 2 and its message contains every needle."""
    assert main(["ablate", path, "--check"]) == 2
    err = capsys.readouterr().err
    for n in needles:
        assert n in err, err
    return err


GLU = """
[[factor]]
name = "glu"
"""


def test_builtin_factor_resolves_with_only_its_key(tmp_path, capsys):
    assert main(["ablate", _write(tmp_path, GLU), "--check"]) == 0
    out = capsys.readouterr().out
    assert "model.hidden_act" in out and "'situ' -> 'silu'" in out
    spec = load_spec(_write(tmp_path, GLU))
    assert list(spec.arms) == ["base", "glu=swiglu"] and spec.factors[0].base_level == "situ"


def test_undeclared_difference_is_refused_and_the_diff_names_the_key(tmp_path, capsys):
    body = """
[[factor]]
name = "glu"
keys = ["model.hidden_act"]
[factor.levels]
situ = {}
swiglu = { model = { hidden_act = "silu" }, train = { lr = 1e-3 } }
"""
    err = _refused(capsys, _write(tmp_path, body), "factor 'glu' level 'swiglu' differs from the base",
                   "! train.lr", "0.003 -> 0.001", "not a declared key of factor 'glu'")
    assert "  model.hidden_act" in err  # the declared difference is listed, unmarked


def test_undeclared_derived_value_is_refused(tmp_path, capsys):
    body = """
[[factor]]
name = "res"
keys = ["model.attn_res_block_size"]
[factor.levels]
on = {}
off = { model = { attn_res_block_size = "none" } }
"""
    _refused(capsys, _write(tmp_path, body), "! derived.params", "! derived.active_params",
             "add it to `varies` or `holds`")


def test_matched_active_parameters_missed_by_more_than_1pct_is_refused(tmp_path, capsys):
    body = """
[[factor]]
name = "latent_moe"
[factor.levels]
latent = {}
standard = { model = { routed_expert_hidden_size = "none", latent_moe_use_norm = false } }
"""
    _refused(capsys, _write(tmp_path, body), "! derived.active_params",
             "factor 'latent_moe' holds active_params within 1.00%; off by")
    # the built-in levels match the width (3d(S + k)F' = the latent layer's active parameters): accepted
    spec = load_spec(_write(tmp_path, '[[factor]]\nname = "latent_moe"\n'))
    a, b = spec.base.derived["active_params"], spec.arms["latent_moe=standard"].derived["active_params"]
    assert abs(b - a) / a <= 0.01 and spec.arms["latent_moe=standard"].derived["params"] != spec.base.derived[
        "params"]


def test_identical_arms_run_once(tmp_path):
    body = GLU + """
[[factor]]
name = "act"
keys = ["model.hidden_act"]
[factor.levels]
base = {}
silu = { model = { hidden_act = "silu" } }
"""
    spec = load_spec(_write(tmp_path, body))
    assert list(spec.arms) == ["base", "glu=swiglu", "act=silu"]
    assert list(spec.runs) == ["base", "glu=swiglu"] and spec.arms["act=silu"].run_id == "glu=swiglu"


@pytest.mark.parametrize("body, needles", [
    ('[[factor]]\nname = "glue"\n', ["unknown factor 'glue'", "built-in factors are attn_res"]),
    ('[[factor]]\nname = "glu"\nkyes = ["model.hidden_act"]\n', ["unknown key 'kyes'", "did you mean 'keys'"]),
    ('[[factor]]\nname = "x"\nkeys = ["model.hiden_act"]\nlevels = { a = {} }\n',
     ["unknown key 'model.hiden_act'", "model.hidden_act"]),
    ('[[factor]]\nname = "x"\nkeys = ["model.hidden_act"]\n[factor.levels]\na = {}\n'
     'b = { model = { hiden_act = "silu" } }\n', ["level 'b'.model", "unknown key 'hiden_act'"]),
    ('[[factor]]\nname = "x"\nkeys = ["train.lr"]\n[factor.levels]\na = {}\nb = { train = { seed = 3 } }\n',
     ["train.seed", "set by `seeds`"]),
    ('[[factor]]\nname = "x"\nkeys = ["train.lr"]\n[factor.levels]\na = {}\nb = { optim = { lr = 1 } }\n',
     ["unknown key 'optim'"]),
    ('[[factor]]\nname = "glu"\n[factor.levels]\nsitu = {}\nsilu = { model = { hidden_act = "situ" } }\n',
     ["level 'silu'", "does not change anything", "as level 'situ' does"]),
    ('[[factor]]\nname = "glu"\n[factor.levels]\nsilu = { model = { hidden_act = "silu" } }\n',
     ["no level resolves to the base configuration"]),
    ('[[factor]]\nname = "glu"\nvaries = ["param"]\n', ["unknown derived value 'param'"]),
    ('[[factor]]\nname = "x"\nkeys = ["train.optimizer"]\n[factor.levels]\na = {}\n'
     'b = { train = { optimizer = "sgd" } }\n', ["level 'b'", "sgd"]),
    ('[[factor]]\nname = "x"\nkeys = ["model.num_experts"]\n[factor.levels]\na = {}\n'
     'b = { model = { num_experts = 1 } }\n', ["level 'b'", "num_experts_per_token"]),
    ('[[factor]]\nname = "x"\nkeys = ["model.hidden_act"]\n[factor.levels]\na = {}\n'
     '"b/c" = { model = { hidden_act = "silu" } }\n', ["level 'b/c'", "letters, digits and '_'"]),
    ('', ["needs at least one [[factor]]"]),
])
def test_bad_factor_input_exits_2(tmp_path, capsys, body, needles):
    _refused(capsys, _write(tmp_path, body), *needles)


@pytest.mark.parametrize("seeds, budget, needle", [
    ("0", "tokens = 256", "seeds: must be a positive integer"),
    ("-2", "tokens = 256", "seeds: must be a positive integer"),
    ("[1, 1]", "tokens = 256", "repeats a seed"),
    ("[]", "tokens = 256", "non-empty list of non-negative integers"),
    ('"3"', "tokens = 256", "seeds: must be a positive integer"),
    ("2.5", "tokens = 256", "seeds: must be a positive integer"),
    ("2", "tokens = 0", "[budget] tokens: must be a positive integer"),
    ("2", "tokens = 200", "not a whole number of steps of batch x seq_len = 4 x 32 = 128"),
    ("2", "steps = -1", "[budget] steps: must be a positive integer"),
    ("2", "steps = 1.5", "[budget] steps: must be a positive integer"),
    ("2", "steps = 2\ntokens = 256", "give exactly one of `tokens`"),
])
def test_bad_seeds_and_budgets_exit_2(tmp_path, capsys, seeds, budget, needle):
    head = HEAD.replace("seeds = 2", f"seeds = {seeds}").replace("tokens = 256", budget)
    _refused(capsys, _write(tmp_path, GLU, head=head), needle)


def test_an_output_directory_of_another_file_is_refused(tmp_path):
    a = load_spec(_write(tmp_path, GLU, name="a.toml"))
    b = load_spec(_write(tmp_path, GLU, head=HEAD.replace("seeds = 2", "seeds = 3"), name="b.toml"))
    out = str(tmp_path / "out")
    claim_out(a, out)
    claim_out(a, out)  # the same file again: continue
    with pytest.raises(AblationSpecError, match=r"holds the results of a different ablation file .*a\.toml.* "
                                                r"differs in seeds"):
        claim_out(b, out)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x").write_text("")
    with pytest.raises(AblationSpecError, match="not empty and holds no ablation.json"):
        claim_out(a, str(tmp_path / "other"))


def test_cli_needs_out_and_names_a_missing_file(tmp_path, capsys):
    assert main(["ablate", _write(tmp_path, GLU)]) == 2
    assert "--out DIR is required" in capsys.readouterr().err
    assert main(["ablate", str(tmp_path / "nope.toml"), "--check"]) == 2
    assert "nope.toml" in capsys.readouterr().err


SHIPPED = sorted(p for p in glob.glob(os.path.join(REPO, "experiments", "ablations", "*.toml"))
                 if "[scaling]" not in open(p).read()            # scaling studies: tests/ablate/test_ablate_scaling.py
                 and 'kind = "decoding"' not in open(p).read())  # decoding studies: tests/ablate/test_decoding_study.py


def test_every_builtin_factor_has_a_shipped_spec():
    stems = {os.path.basename(p)[:-5] for p in SHIPPED}
    assert set(FACTORS) <= stems
    # the recorded three-factor grid; the optimizer-state study (a declared factor, not a built-in one)
    assert stems - set(FACTORS) == {"micro3", "opt_state"}
    assert [f.name for f in load_spec(os.path.join(REPO, "experiments", "ablations", "micro3.toml")).factors] == [
        "attn_res", "glu", "optimizer"]


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: os.path.basename(p)[:-5])
def test_shipped_specs_resolve_with_only_declared_differences(path):
    from k3jax.plan.formula import build_plan

    spec = load_spec(path)
    assert spec.base.cfg.name == "k3-micro" and len(spec.seeds) >= 5 and spec.aa_seeds and spec.aa["repeat"]
    assert len(spec.runs) == len(spec.arms) >= 2  # no duplicate arms
    for n, arm in spec.arms.items():
        assert arm.derived["tokens"] == spec.base.derived["tokens"]
        assert arm.derived["data_order"] == spec.base.derived["data_order"]
        assert arm.derived["eval_windows"] == spec.base.derived["eval_windows"]
        assert arm.derived["active_params"] == build_plan(arm.cfg, meshes=())["active_params"]  # k3 plan's count
        if n != "base":
            assert format_diff(spec.base, arm)  # it changes something


def test_a_batch_factor_keeps_the_token_budget_and_must_declare_the_data_order(tmp_path, capsys):
    body = '[[factor]]\nname = "bs"\nkeys = ["train.batch"]\n[factor.levels]\nb4 = {}\nb8 = { train = { batch = 8 } }\n'
    _refused(capsys, _write(tmp_path, body), "! derived.data_order", "  train.steps")  # steps: implied by batch
    spec = load_spec(_write(tmp_path, body.replace('keys = ["train.batch"]',
                                                   'keys = ["train.batch"]\nvaries = ["data_order"]')))
    arm = spec.arms["bs=b8"]
    assert arm.derived["tokens"] == spec.base.derived["tokens"] == 256
    assert (arm.train["steps"], spec.base.train["steps"]) == (1, 2)
    assert arm.train["eval_every"] == spec.base.train["eval_every"]
