"""Every mistake in a plan is reported as file:line:col with what was expected.

One test per error class the plan language promises; each checks the message and the line.
"""

import pytest
from helpers import run_main, tpplan_cli

import tpplan
from tpplan.analysis.dryrun import dry_run

BASE = """\
mesh: {tp: 2, dp_shard: -1}
model: {name: llama3, config: debug}
fsdp: {units: ["layers.*"]}
"""


def errors_of(path: str, world: int = 4, overrides=()) -> list:
    """The plan's mistakes at ``world`` ranks, as `tpplan validate` reports them."""
    return dry_run(path, world, overrides).errors


def one_error(path: str, **kw):
    errors = errors_of(path, **kw)
    assert len(errors) == 1, [str(e) for e in errors]
    return errors[0]


def test_yaml_syntax_error_has_line_and_column(write_plan):
    e = one_error(write_plan(BASE + "tensor_parallel:\n  output: {style: colwise\n"))
    assert "YAML syntax error" in e.message
    assert e.loc.line == 6


def test_duplicate_key_is_an_error_not_last_wins(write_plan):
    e = one_error(write_plan(BASE + "tensor_parallel:\n  output: colwise\n  output: rowwise\n"))
    assert "duplicate key 'output'" in e.message and "first defined at line 5" in e.message
    assert (e.loc.line, e.loc.column) == (6, 3)


def test_unknown_section_suggests_nearest(write_plan):
    e = one_error(write_plan(BASE + "tensor_paralel:\n  output: colwise\n"))
    assert "unknown section 'tensor_paralel'" in e.message
    assert "did you mean 'tensor_parallel'" in e.message
    assert e.loc.line == 4


def test_unknown_key_in_section(write_plan):
    e = one_error(write_plan("mesh: {tp: 2, dp_shrd: -1}\nmodel: {name: llama3}\n"))
    assert "unknown key 'dp_shrd' in 'mesh'" in e.message and "'dp_shard'" in e.message
    assert (e.loc.line, e.loc.column) == (1, 15)


def test_unknown_style_suggests_nearest(write_plan):
    e = one_error(write_plan(BASE + "tensor_parallel:\n  output: colwsie\n"))
    assert "unknown style 'colwsie'" in e.message and "did you mean 'colwise'" in e.message
    assert (e.loc.line, e.loc.column) == (5, 11)


def test_unknown_style_option(write_plan):
    e = one_error(write_plan(BASE + "tensor_parallel:\n  output: {style: colwise, output_layout: "
                                    "shard(-1)}\n"))
    assert "no option 'output_layout'" in e.message and "'output_layouts'" in e.message
    assert e.loc.line == 5


def test_bad_layout(write_plan):
    e = one_error(write_plan(BASE + "tensor_parallel:\n  output: {style: colwise, "
                                    "input_layouts: shard_1}\n"))
    assert "'shard_1' is not a layout" in e.message
    assert e.loc.line == 5


def test_bad_layout_inside_a_list(write_plan):
    e = one_error(write_plan(BASE + "tensor_parallel:\n  layers.*.attention:\n"
                                    "    style: prepare_input\n"
                                    "    input_layouts: [shard(1), nul]\n"
                                    "    desired_input_layouts: [replicate, null]\n"))
    assert "'nul' is not a layout" in e.message
    assert (e.loc.line, e.loc.column) == (7, 31)


def test_wrong_type(write_plan):
    e = one_error(write_plan("mesh: {tp: two}\nmodel: {name: llama3}\n"))
    assert "'mesh.tp' must be an integer" in e.message and "'two'" in e.message
    assert (e.loc.line, e.loc.column) == (1, 12)


def test_pattern_that_matches_nothing_suggests_a_module(write_plan):
    e = one_error(write_plan(BASE + "tensor_parallel:\n  layers.*.attention.w_q: colwise\n"))
    assert "matches no module" in e.message and "did you mean 'layers.*.attention.wq'" in e.message
    assert (e.loc.line, e.loc.column) == (5, 3)


def test_pattern_naming_a_parameter(write_plan):
    e = one_error(write_plan(BASE + "tensor_parallel:\n  output.weight: colwise\n"))
    assert "names a parameter, not a module" in e.message and "'output'" in e.message


def test_module_matched_by_two_rules_names_both(write_plan):
    e = one_error(write_plan(BASE + "tensor_parallel:\n  layers.*.attention.{wq,wk}: colwise\n"
                                    "  layers.*.attention.wq: rowwise\n"))
    assert "matched by two rules" in e.message
    assert "'layers.*.attention.{wq,wk}' (line 5)" in e.message
    assert "'layers.*.attention.wq' (line 6)" in e.message
    assert e.loc.line == 6


def test_style_on_a_module_it_cannot_shard(write_plan):
    e = one_error(write_plan(BASE + "tensor_parallel:\n  norm: colwise\n"))
    assert "cannot shard module 'norm' (RMSNorm)" in e.message
    assert "nn.Linear and nn.Embedding" in e.message and e.loc.line == 5


def test_dimension_not_divisible_by_tp(write_plan):
    # debug Llama: the SwiGLU hidden size is 384, not divisible by 5
    path = write_plan("mesh: {tp: 5}\nmodel: {name: llama3}\nfsdp: {}\n"
                      "tensor_parallel:\n  layers.*.feed_forward.w2: rowwise\n")
    e = one_error(path, world=5)  # once for the rule, not once per layer
    assert "module 'layers.0.feed_forward.w2' (Linear), parameter 'weight': dimension 1 of " \
           "size 384 is not divisible by tp=5" in e.message
    assert "(and 3 more modules like it)" in e.message
    assert e.loc.line == 5


def test_divide_by_tp_missing_attribute(write_plan):
    e = one_error(write_plan(BASE + "divide_by_tp: [layers.*.attention.n_head]\n"))
    assert "has no attribute 'n_head'" in e.message and "did you mean 'n_heads'" in e.message
    assert (e.loc.line, e.loc.column) == (4, 16)


def test_divide_by_tp_not_an_integer(write_plan):
    e = one_error(write_plan(BASE + "divide_by_tp: [layers.*.attention.wq]\n"))
    assert "not an integer" in e.message and e.loc.line == 4


def test_divide_by_tp_not_divisible(write_plan):
    # n_kv_heads is 4: fine on tp=2 and tp=4, not on tp=8
    path = write_plan("mesh: {tp: 8}\nmodel: {name: llama3}\n"
                      "divide_by_tp: [layers.*.attention.n_kv_heads]\n")
    e = one_error(path, world=8)
    assert e.message == ("divide_by_tp: 'layers.0.attention.n_kv_heads' = 4 is not divisible by "
                         "tp=8 (and 3 more modules like it)")
    assert e.loc.line == 3


def test_mesh_that_does_not_fit_names_every_factor(write_plan):
    assert errors_of(write_plan(BASE, name="fits.yaml"), world=6,  # dp_shard -1 -> 3
                     overrides=["train.global_batch_size=6"]) == []
    e = one_error(write_plan("mesh: {tp: 4, dp_shard: 2, dp_replicate: 1}\nmodel: {name: llama3}\n"
                             "fsdp: {}\n"), world=6)
    assert "dp_replicate=1 × dp_shard=2 × tp=4 = 8 ranks does not fit world size 6" in e.message
    assert e.loc.line == 1


def test_mesh_rest_that_does_not_divide(write_plan):
    e = one_error(write_plan("mesh: {tp: 4}\nmodel: {name: llama3}\nfsdp: {}\n"), world=6)
    assert "dp_replicate × tp = 4 does not divide 6" in e.message


def test_data_parallel_without_fsdp_is_an_error(write_plan):
    e = one_error(write_plan("mesh: {tp: 2}\nmodel: {name: llama3}\n"), world=4)
    assert "2 data-parallel ranks but the plan has no 'fsdp' section" in e.message


def test_sequence_length_under_sequence_parallel(write_plan):
    e = one_error(write_plan(BASE + "tensor_parallel:\n  norm: sequence_parallel\n"
                                    "train: {seq_len: 255}\n"))
    assert "train.seq_len=255 is not divisible by tp=2" in e.message and e.loc.line == 6


def test_alias_bomb_is_refused(write_plan):
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 9):
        prev = f"*a{i-1}"
        lines.append(f"a{i}: &a{i} [{', '.join([prev] * 10)}]")
    e = one_error(write_plan("\n".join(lines) + "\n"))
    assert "alias bomb" in e.message


def test_oversized_file_is_refused(write_plan):
    e = one_error(write_plan("# " + "x" * (2 << 20) + "\n"))
    assert "refused" in e.message and "bytes" in e.message


def test_unsafe_tags_are_not_constructed(write_plan):
    e = one_error(write_plan("mesh: !!python/object/apply:os.system ['echo pwned']\n"))
    assert e.loc.line == 1  # the safe loader has no constructor for it: an error, not a call


def test_many_errors_reported_at_once_in_file_order(write_plan):
    errors = errors_of(write_plan(BASE + "tensor_parallel:\n  output: colwsie\n  norm: {style: "
                                         "replicate, foo: 1}\nloss_parallel: yes please\n"))
    assert [e.loc.line for e in errors] == [5, 6, 7]


def test_extends_cycle(write_plan):
    write_plan("extends: b.yaml\nmesh: {tp: 2}\n", name="a.yaml")
    e = one_error(write_plan("extends: a.yaml\n", name="b.yaml"))
    assert "'extends' forms a cycle" in e.message


def test_override_with_bad_value_points_at_the_override(root):
    e = one_error(str(root / "plans/llama.yaml"), overrides=["mesh.tp=two"])
    assert e.loc.file == "--set mesh.tp=two" and e.loc.column == 9
    assert "'mesh.tp' must be an integer" in e.message


@pytest.mark.parametrize("args", [["validate", "--world-size", "4"]])
def test_cli_prints_located_errors_without_traceback(write_plan, args):
    path = write_plan(BASE + "tensor_parallel:\n  layers.*.attention.w_q: colwise\n")
    proc = tpplan_cli(*args, "--plan", path)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr + proc.stdout
    assert f"{path}:5:3: error: pattern 'layers.*.attention.w_q' matches no module" in proc.stderr


def test_unsafe_scalar_tag_is_located(write_plan):
    e = one_error(write_plan("model: {name: llama3}\nmesh: !!python/name:os.system\n"))
    assert "YAML tag 'tag:yaml.org,2002:python/name:os.system' is not allowed" in e.message
    assert e.loc.line == 2


def test_prepare_input_needs_its_desired_layouts(write_plan):
    e = one_error(write_plan(BASE + "tensor_parallel:\n  layers.*.attention: {style: prepare_input,"
                                    " input_layouts: [shard(1), null]}\n"))
    assert "has 'input_layouts' but no 'desired_input_layouts'" in e.message and e.loc.line == 5


def test_prepare_input_lists_must_line_up(write_plan):
    e = one_error(write_plan(BASE + "tensor_parallel:\n  layers.*.attention:\n"
                                    "    style: prepare_input\n"
                                    "    input_layouts: [shard(1), null]\n"
                                    "    desired_input_layouts: [replicate]\n"))
    assert "'input_layouts' is a list of 2 but 'desired_input_layouts' is a list of 1" in e.message
    assert e.loc.line == 8


def test_override_with_null_removes_a_rule(root):
    plan = tpplan.load(root / "plans/llama.yaml", overrides=["tensor_parallel.norm=null"])
    assert "norm" not in {r.pattern for r in plan.rules}


def test_every_train_key_train_rejects_is_a_validate_error_at_its_line(write_plan):
    """validate reads the trainer's sections with the trainer's own reader."""
    errors = errors_of(write_plan(BASE + "train:\n  gradient_accumulation_steps: 4\n  lr: true\n"
                                         "  grad_clip: .nan\n  steps: 1.5\n"))
    assert [(e.loc.line, e.loc.column) for e in errors] == [(5, 3), (6, 7), (7, 14), (8, 10)]
    assert "unknown key 'gradient_accumulation_steps' in 'train'" in errors[0].message
    assert errors[1].message == "'train.lr' must be a number, got a boolean True"
    assert errors[2].message == "'train.grad_clip' must be a finite number, got nan"
    assert "'train.steps' must be an integer, got a number 1.5" in errors[3].message


def test_metrics_dry_run_is_a_boolean_at_its_line(write_plan):
    """``metrics.dry_run`` (rank 0's dry run before the first step) takes true or false."""
    e = one_error(write_plan(BASE + "metrics: {log_interval: 2, dry_run: sometimes}\n"))
    assert (e.loc.line, e.loc.column) == (4, 37)
    assert e.message == "'metrics.dry_run' must be true or false, got a string 'sometimes'"
    assert tpplan.load(write_plan(BASE + "metrics: {dry_run: false}\n")).spec.metrics.dry_run is False
    assert tpplan.load(write_plan(BASE)).spec.metrics.dry_run is True


def test_a_batch_that_does_not_split_over_the_mesh_is_an_error(write_plan):
    e = one_error(write_plan(BASE + "train: {global_batch_size: 6}\n"), world=8)  # dp 4
    assert e.message.startswith("train.global_batch_size=6 is not divisible by the "
                                "data-parallel size 4") and "(e.g. 4 or 8)" in e.message
    assert (e.loc.line, e.loc.column) == (4, 28)  # the value 6
    # Left out, the default is named as such, and where to set it.
    e = one_error(write_plan(BASE, name="default.yaml"), world=32)  # dp 16 > the default 8
    assert "train.global_batch_size=8 (the default; set train.global_batch_size)" in e.message


def test_local_batch_size_scales_the_global_batch_with_the_mesh(write_plan):
    """``train.local_batch_size`` alone: the global batch is local × dp at any world size."""
    path = write_plan(BASE + "train: {local_batch_size: 3, seq_len: 32}\n")
    for world, dp in ((4, 2), (64, 32)):
        shape = tpplan.load(path).step_shape(world)
        assert (shape.global_batch, shape.micro_batch, shape.grad_accum) == (3 * dp, 3, 1)


def test_local_and_global_batch_sizes_must_agree(write_plan):
    path = write_plan(BASE + "train: {global_batch_size: 8, local_batch_size: 2}\n")
    assert tpplan.load(path).step_shape(8).global_batch == 8  # dp 4: 2 × 4 = 8, consistent
    e = one_error(path, world=4)  # dp 2: 2 × 2 = 4, not 8
    assert e.message.startswith("train.local_batch_size=2 × dp=2 is 4 sequences per step, but "
                                "train.global_batch_size=8")
    assert (e.loc.line, e.loc.column) == (4, 49)  # the local value


def test_one_batch_size_given_later_replaces_the_other(write_plan):
    """A child plan or a --set that gives one of the two replaces the other given earlier:
    they say one thing two ways."""
    parent = write_plan(BASE + "train: {global_batch_size: 8}\n", name="parent.yaml")
    child = write_plan(f"extends: {parent}\ntrain: {{local_batch_size: 5}}\n", name="child.yaml")
    assert tpplan.load(child).step_shape(4).global_batch == 10
    assert tpplan.load(child, ["train.global_batch_size=6"]).step_shape(4).global_batch == 6
    assert tpplan.load(parent, ["train.local_batch_size=1"]).step_shape(4).global_batch == 2
    both = ["train.global_batch_size=6", "train.local_batch_size=1"]  # both in one place
    assert "but train.global_batch_size=6" in one_error(child, world=4, overrides=both).message


def test_activation_checkpointing_every_only_with_selective(write_plan):
    e = one_error(write_plan(BASE + "activation_checkpointing: {mode: full, every: 2}\n"))
    assert "'activation_checkpointing.every' applies to mode selective only" in e.message
    assert (e.loc.line, e.loc.column) == (4, 47)
    e = one_error(write_plan(BASE + "activation_checkpointing: ful\n", name="typo.yaml"))
    assert "mode must be one of none, full, selective, op, got 'ful' (did you mean 'full'?)" in e.message


OPTIMIZER_MISTAKES = [  # (train section, line and column of the value, message)
    ("  eps: -1\n", "5:8", "'train.eps' must be positive, got -1.0"),
    ("  betas: [2, 3]\n", "5:11", "'train.betas' must each be in [0, 1) (AdamW's moment decay), "
                                  "got 2.0 as beta1"),
    ("  betas: [0.9, .nan]\n", "5:16", "'train.betas' must each be in [0, 1) (AdamW's moment "
                                       "decay), got nan as beta2"),
    ("  lr: .inf\n", "5:7", "'train.lr' must be a finite number, got inf"),
    ("  grad_clip: .nan\n", "5:14", "'train.grad_clip' must be a finite number, got nan"),
    ("  lr: 1.0e-3\n  min_lr: 1.0e-2\n", "6:11", "'train.min_lr' (0.01) is above 'train.lr' "
                                               "(0.001): the cosine would raise the learning rate "
                                               "instead of decaying it"),
    ("  lr: 0.1\n  weight_decay: 20\n", "6:17", "'train.lr' × 'train.weight_decay' = 0.1 × 20.0 "
                                               "= 2, at least 1: AdamW's decoupled decay "
                                               "(w -= lr·wd·w) would zero or flip every weight "
                                               "each step"),
]


@pytest.mark.parametrize("train, where, message", OPTIMIZER_MISTAKES)
def test_optimizer_numbers_that_make_a_run_meaningless_are_validate_errors(
        capsys, write_plan, train, where, message):
    plan = write_plan(BASE + "train:\n" + train)
    rc, out = run_main(capsys, "validate", "--plan", plan, "--world-size", "4")
    assert rc == 1
    assert out.splitlines()[0] == f"{plan}:{where}: error: {message}"


@pytest.mark.parametrize("train, where, message", OPTIMIZER_MISTAKES[:5])
def test_train_refuses_optimizer_numbers_before_the_process_group(write_plan, tmp_path, train,
                                                                  where, message):
    plan = write_plan(BASE.replace("tp: 2", "tp: 1") + "train:\n" + train)
    proc = tpplan_cli("train", "--plan", plan, "--set", f"metrics.run_dir={tmp_path / 'run'}",
                      timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.splitlines()[0] == f"{plan}:{where}: error: {message}"
    assert not (tmp_path / "run").exists()  # rank 0 makes it once the process group is up


def test_train_on_several_ranks_refuses_eps_and_betas_once_before_any_collective(write_plan,
                                                                                tmp_path):
    plan = write_plan(BASE + "train:\n  eps: -1\n  betas: [2, 3]\n")
    proc = tpplan_cli("train", "--plan", plan, "--nproc", "2", "--set", "mesh.tp=1", "--set",
                      f"metrics.run_dir={tmp_path / 'run'}", timeout=180)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if ": error: " in line]
    assert errors == [f"{plan}:5:8: error: 'train.eps' must be positive, got -1.0",
                      f"{plan}:6:11: error: 'train.betas' must each be in [0, 1) (AdamW's moment "
                      "decay), got 2.0 as beta1",
                      f"{plan}:6:14: error: 'train.betas' must each be in [0, 1) (AdamW's moment "
                      "decay), got 3.0 as beta2"]  # once, from rank 0
    assert not (tmp_path / "run").exists()


def test_warmup_longer_than_the_run_and_min_lr_equal_to_lr_are_fine(write_plan):
    assert errors_of(write_plan(BASE + "train: {steps: 10, warmup_steps: 100, lr: 1.0e-3, "
                                       "min_lr: 1.0e-3}\n")) == []
