"""Every option of every config group composes against the schema and builds its object; bad
input fails with one line, exit code 2, no worker and no run dir."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from torch.utils.data import default_collate

from cli_jobs import entry_point_error
from gradsync.components import build, locate, parameters
from gradsync.config.renames import RENAMED
from gradsync.config.schema import RunConfig
from gradsync.config.validate import RUNTIME, ConfigError
from gradsync.core.dtypes import DTYPES
from gradsync.run.main import CONF_DIR, compose_plain, register_schemas
from gradsync.run.preflight import preflight
from gradsync.train import weight_decay
from gradsync.train.precision import Precision
from gradsync.train.schedules import build_schedule
from gradsync.train.weight_decay import build_optimizer
from test_renames import WINDOW_CASES

register_schemas()
GROUPS = ["model", "optimizer", "schedule", "sync", "precision", "data", "trainer",
          "lr_scheduler", "loss"]
# token data and the transformer only go together
COMPANIONS = {("data", "synthetic_lm"): "model=transformer",
              ("data", "stdlib_text"): "model=transformer",
              ("model", "transformer"): "data=synthetic_lm",
              ("model", "hf_llama"): "data=synthetic_lm"}
# what each built-in policy answers for the micro-batches of a window of 4
SYNCS = {"always": [True] * 4, "accumulate": [False, False, False, True],
         "amp_aware": [False, False, False, True],
         "local_sgd": [False] * 4, "diloco": [False] * 4}  # no warm-up: every window local


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (Path(CONF_DIR) / group).glob("*.yaml"))


ALL = [(g, o) for g in GROUPS for o in options(g)]


@pytest.mark.parametrize("group,option", ALL, ids=[f"{g}={o}" for g, o in ALL])
def test_every_option_composes_validates_and_builds(group, option):
    overrides = [f"{group}={option}"]
    if (group, option) in COMPANIONS:
        overrides.append(COMPANIONS[group, option])
    if group == "schedule" and option == "global_batch":
        overrides.append("schedule.global_batch_size=64")  # 2 ranks x micro 16 x 2
    cfg = compose_plain(overrides)
    preflight(cfg)
    run = RunConfig.from_plain(cfg)
    small = {"num_samples": 64} if "num_samples" in cfg["data"] else {}
    data = build({**cfg["data"], **small}, {"seed": cfg["seed"]})
    model = build(cfg["model"], data.sizes)
    x, y = (data.collate or default_collate)([data.train[i] for i in range(4)])
    sums, counts = data.loss(model(x), y)
    assert sums.shape == counts.shape == (4,) and (counts >= 1).all()
    opt = build_optimizer(cfg["optimizer"], model, model.parameters())
    assert type(opt).__name__.lower() == cfg["optimizer"]["_target_"].split(".")[-1].lower()
    assert opt.param_groups[0]["lr"] == cfg["optimizer"]["lr"]
    sched = build(cfg["lr_scheduler"], {"optimizer": opt, "total_steps": 10})
    assert sched.get_last_lr()[0] > 0
    schedule = build_schedule(run.schedule, world_size=2)
    assert schedule.window_size(0) >= 1
    policy = build(cfg["sync"])
    assert [policy.should_sync(i, 4) for i in range(4)] == SYNCS[policy.name]
    with Precision(run.precision.name, "cpu").autocast():
        out_dtype = torch.nn.functional.linear(torch.ones(2, 2), torch.ones(2, 2)).dtype
    assert out_dtype == (DTYPES[run.precision.name] or torch.float32)


COMPONENT_GROUPS = [(g, o) for g in RUNTIME for o in options(g)]


@pytest.mark.parametrize("group,option", COMPONENT_GROUPS,
                         ids=[f"{g}={o}" for g, o in COMPONENT_GROUPS])
def test_a_gradsync_components_yaml_states_its_own_signature_defaults(group, option):
    """conf/ lists a component's keys so they can be overridden without '+', each a keyword of
    the callable; the values are gradsync's callable's own defaults (one source: the
    signature), or, for torch's optimizers, the values the YAML chooses, which reach the
    optimizer as they are (an optimizer's no_decay is gradsync's: train/weight_decay.py)."""
    node = yaml.safe_load((Path(CONF_DIR) / group / f"{option}.yaml").read_text())
    if group == "optimizer":
        node, no_decay = weight_decay.split(node)
        assert no_decay == ["bias", "norm"]  # nanoGPT's and HF Trainer's rule
    params = parameters(locate(node["_target_"]))
    keys = [k for k in node if not k.startswith("_")]
    assert set(keys) <= set(params), set(keys) - set(params)
    if not node["_target_"].startswith("gradsync."):
        assert group == "optimizer", node["_target_"]
        optimizer = build(node)([torch.nn.Parameter(torch.zeros(2))])
        for key in keys:
            value = optimizer.defaults[key]
            assert (list(value) if isinstance(value, tuple) else value) == node[key], key
        return
    for key in keys:
        default = params[key].default
        assert node[key] == (list(default) if isinstance(default, tuple) else default), key


def test_schema_group_yamls_state_only_what_differs_from_the_schema():
    from gradsync.config.schema import SCHEMA_GROUPS

    for group, schemas in SCHEMA_GROUPS.items():
        paths = sorted((Path(CONF_DIR) / group).glob("*.yaml"))
        assert {p.stem for p in paths} >= set(schemas) - {"default"} and paths, group
        for path in paths:  # engine/: one schema for every engine's file
            option = path.stem
            schema = schemas.get(option) or next(iter(schemas.values()))
            node = yaml.safe_load(path.read_text())
            defaults = schema()
            for key, value in node.items():
                if key != "defaults":
                    assert value != getattr(defaults, key), f"{group}/{option}: {key}"


def test_every_engine_has_its_conf_entry_and_no_other():
    """conf/engine/<name>.yaml for each of gradsync.engines.ENGINES (adding an engine: its
    module, registering it, and this file), each composing to its own name."""
    from gradsync.engines import ENGINES

    names = sorted(p.stem for p in (Path(CONF_DIR) / "engine").glob("*.yaml"))
    assert names == sorted(ENGINES) and len(names) >= 4
    assert [compose_plain([f"engine={n}"])["engine"]["name"] for n in names] == names
    assert compose_plain([])["engine"]["name"] == "torch_ddp"


def test_default_experiment_is_digits_mlp_two_workers_accumulate_4_fp32():
    cfg = compose_plain([])
    assert (cfg["data"]["_target_"], cfg["model"]["_target_"], cfg["trainer"]["devices"]) == \
        ("gradsync.data.digits", "gradsync.models.MLP", 2)
    assert (cfg["sync"]["_target_"], cfg["schedule"]["window_size"],
            cfg["precision"]["name"]) == ("gradsync.sync.policies.AccumulateSync", 4, "fp32")


def test_global_batch_schedule_derives_n_from_world_and_micro_batch():
    cfg = compose_plain(["schedule=global_batch", "schedule.global_batch_size=96",
                         "schedule.micro_batch_size=8", "trainer.devices=3"])
    preflight(cfg)
    assert build_schedule(RunConfig.from_plain(cfg).schedule, 3).window_size(0) == 4
    cfg["schedule"]["global_batch_size"] = 100
    with pytest.raises(ConfigError, match="schedule.global_batch_size.*3 x 8 = 24"):
        preflight(cfg)


def test_nccl_without_cuda_is_refused():
    cfg = compose_plain(["trainer.backend=nccl"])
    with pytest.raises(ConfigError, match="trainer.backend"):
        preflight(cfg)


# Refused by preflight(), each with the one line the command line prints after "config error: ".
REFUSED = [
    (["schedule.window_size=0"], "schedule.window_size=0 is not allowed: an integer >= 1"),
    (["schedule.window_size=-3"], "schedule.window_size=-3 is not allowed"),
    (["schedule=global_batch", "schedule.global_batch_size=100"],
     "schedule.global_batch_size=100 is not allowed: a positive multiple of world_size x "
     "schedule.micro_batch_size = 2 x 16 = 32"),
    (["trainer.devices=0"], "trainer.devices=0 is not allowed: an integer >= 1"),
    (["schedule.micro_batch_size=0"], "schedule.micro_batch_size=0 is not allowed"),
    (["trainer.backend=mpi"], "trainer.backend='mpi' is not allowed: one of auto, gloo, nccl"),
    (["sync=amp_aware", "sync.comm_dtype=int8"],
     "sync.comm_dtype='int8' is not allowed: one of fp32, bf16, fp16"),
    (["sync=amp_aware", "sync.comm_dtype=fp16"],
     "sync.comm_dtype='fp16' needs precision=fp16, not 'fp32'"),
    (["data=synthetic_lm"], "model: gradsync.models.MLP needs in_dim, which data "
     "(gradsync.data.synthetic_lm) does not provide (it provides vocab_size, max_len)"),
    (["loss.normalize=tokens"], "loss.normalize='tokens' needs token data; data "
     "(gradsync.data.digits) counts samples: use auto or samples"),
    # keys of a sibling option (accepted and ignored before components were checked)
    (["+model.d_model=64"], "model.d_model: unknown key for gradsync.models.MLP; accepted "
     "keys: activation, dropout, hidden_sizes"),
    (["+sync.comm_dtype=fp16"], "sync.comm_dtype: unknown key for "
     "gradsync.sync.policies.AccumulateSync; accepted keys: compression, groups, powersgd_rank"),
    (["+sync.uses_scaler=true"], "sync.uses_scaler: set by gradsync at run time"),
    (["schedule=constant", "+schedule.global_batch_size=64"],
     "schedule.global_batch_size: unknown key; allowed keys: micro_batch_size, name, window_size"),
    (["model._target_=nosuchpackage.Model"], "model._target_='nosuchpackage.Model': no module"),
    (["model._target_=gradsync.models.NoSuchModel"],
     "model._target_='gradsync.models.NoSuchModel': gradsync.models has no NoSuchModel"),
    # every numeric option range-checked (a crash after training, or a silent no-op, before)
    (["experiment=lm_accum_sweep", "model.n_heads=0"],
     "model.n_heads=0 is not allowed: an integer >= 1"),
    (["seed=-1"], "seed=-1 is not allowed: an integer in [0, 2**63)"),
    (["data=synthetic", "data.eval_samples=0"], "data.eval_samples=0 is not allowed"),
    (["data.test_fraction=1.5"], "data.test_fraction=1.5 is not allowed: a number in (0, 1)"),
    (["data=synthetic", "data.in_dim=0"], "data.in_dim=0 is not allowed: an integer >= 1"),
    (["precision=fp16", "precision.init_scale=inf"],
     "precision.init_scale=inf is not allowed: a finite number > 0"),
    (["optimizer.lr=nan"], "optimizer.lr=nan is not allowed: finite numbers"),
    (["optimizer.lr=-1"], "optimizer (torch.optim.SGD) refuses its arguments: ValueError: "
     "Invalid learning rate: -1"),
    # torch accepts eps=0, and the loss is NaN at step 2 (a gradient of exactly 0 divided by 0)
    (["optimizer=adamw", "optimizer.eps=0"], "optimizer.eps=0 is not allowed: a positive number "
     "(AdamW divides by sqrt(v) + eps: with eps=0 a parameter whose gradients are 0 gets a NaN "
     "step)"),
    (["optimizer=adamw", "optimizer.betas=[0.9]"],
     "optimizer.betas=[0.9] is not allowed: torch.optim.AdamW takes a list of 2 floats"),
    (["engine.bucket_cap_mb=0"], "engine.bucket_cap_mb=0.0 is not allowed: a finite number > 0"),
    (["sync.powersgd_rank=0"], "sync.powersgd_rank=0 is not allowed: an integer >= 1"),
    (["lr_scheduler.min_lr_ratio=2"], "lr_scheduler.min_lr_ratio=2 is not allowed"),
    (["trainer.bits=exact"], "trainer.bits='exact' is not allowed: one of native, portable"),
    # issue 26: values that reached the workers (tests/test_options.py covers every option)
    (["optimizer.fused=maybe"],
     "optimizer.fused='maybe' is not allowed: torch.optim.SGD takes true or false, or "
     "null"),
    (["data.split_seed=-1"], "data.split_seed=-1 is not allowed: an integer >= 0"),
    (["trainer.timeout_s=100000000000000000000"],
     "trainer.timeout_s=100000000000000000000 is not allowed: an integer >= 1 (at most "
     "1000000000)"),
    (["model.hidden_sizes=[1000000000000]"], "model.hidden_sizes=[1000000000000]: the MLP's "
     "75,000,000,000,010 parameters (in_dim=64, out_dim=10 from the data) would take 272.8 "
     "TiB, more than this machine's memory"),
]


@pytest.mark.parametrize("args,expected", REFUSED, ids=[" ".join(a) for a, _ in REFUSED])
def test_bad_values_are_refused_naming_the_key(args, expected):
    with pytest.raises(ConfigError) as err:
        preflight(compose_plain(args))
    assert str(err.value).startswith(expected), str(err.value)


def test_an_epochwise_map_with_new_epochs_replaces_the_default_map():
    cfg = compose_plain(["schedule=epochwise", "schedule.window_size_by_epoch={0:2,3:8}"])
    preflight(cfg)
    assert cfg["schedule"]["window_size_by_epoch"] == {0: 2, 3: 8}
    sched = build_schedule(RunConfig.from_plain(cfg).schedule, 2)
    assert [sched.window_size(e) for e in range(5)] == [2, 2, 2, 8, 8]


# The command line: one line, exit 2, no run dir, also for errors Hydra raises while composing
# and for a component check that raises something other than ConfigError.
BAD = [
    (["sync=foo"], "sync=foo: no such option; choose one of: accumulate, always, amp_aware"),
    (["trainer.foo=1"], "trainer.foo: unknown key; allowed keys: backend, bits, check_replicas"),
    (["+bogus=1"], "bogus: unknown key; allowed keys: compile, data, engine, logger, loss, "
                   "lr_scaling, lr_scheduler"),
    (["schedule.window_size=abc"], "schedule.window_size: Value 'abc'"),
    (["sync.name=amp_aware"], "sync.name: unknown key for gradsync.sync.policies.AccumulateSync; "
     "accepted keys: compression, groups, powersgd_rank, powersgd_start_backwards"),
    (["data._target_=components_for_tests.data_whose_check_fails"],
     "config error: ZeroDivisionError: division by zero"),
    (["data.test_fraction=1.5"], "data.test_fraction=1.5 is not allowed: a number in (0, 1)"),
    # the policy contract (sync/policy.py), checked before any worker starts
    (["sync._target_=components_for_tests.NoShouldSync", "~sync.compression",
      "~sync.powersgd_rank", "~sync.powersgd_start_backwards", "~sync.groups",
      "~sync.reduce_scatter", "~sync.replica_all_reduce"],
     "sync (components_for_tests.NoShouldSync): returned a NoShouldSync, which is no sync "
     "policy: a sync policy has a method should_sync(micro_index, window_size) -> bool"),
    # a member of the earlier contract on the policy: refused, naming the role it moved to
    (["sync._target_=components_for_tests.Periodic", "~sync.compression",
      "~sync.powersgd_rank", "~sync.powersgd_start_backwards", "~sync.groups",
      "~sync.reduce_scatter", "~sync.replica_all_reduce"],
     "sync (components_for_tests.Periodic): Periodic.after_window is no longer called on a "
     "policy: it moved to the averager role (sync/averaging.py Averager); give the policy that "
     "role (docs/components.md)"),
    (["sync._target_=components_for_tests.ShouldSyncOfOneArgument", "~sync.compression",
      "~sync.powersgd_rank", "~sync.powersgd_start_backwards", "~sync.groups",
      "~sync.reduce_scatter", "~sync.replica_all_reduce"],
     "sync (components_for_tests.ShouldSyncOfOneArgument): "
     "ShouldSyncOfOneArgument.should_sync(micro_index: 'int') -> 'bool' cannot be called as "
     "should_sync(micro_index, window_size)"),
]


@pytest.mark.slow
@pytest.mark.parametrize("args,expected", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_one_line_exit_2_and_leaves_nothing(args, expected, tmp_path, cli_env):
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "gradsync.run.main", *args, f"hydra.run.dir={run_dir}"],
        capture_output=True, text=True, env=cli_env, timeout=120, cwd=Path(__file__).parent)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("gradsync: config error: ")
    assert expected in lines[0]
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert not run_dir.exists()  # no run dir left, so no worker ever started


def test_the_lock_pins_every_dependency_inside_pyprojects_range():
    """make install installs requirements.lock, then gradsync with --no-deps: a dependency
    pyproject.toml names (the dev tools and every extra included) that the lock lacks, or pins
    outside pyproject's range, is never installed or contradicts what the package claims. torch
    stays a range in pyproject (2.11 and 2.13 at least) and one exact CPU build in the lock."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the tomli pip vendors
        from pip._vendor import tomli as tomllib

    repo = Path(CONF_DIR).parent
    project = tomllib.loads((repo / "pyproject.toml").read_text())["project"]
    wanted = [Requirement(r) for r in [*project["dependencies"],
                                       *project["optional-dependencies"]["dev"]]]
    pins = {}
    for line in (repo / "requirements.lock").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version
    for reqs in project["optional-dependencies"].values():  # make install: every extra
        wanted += [r for r in map(Requirement, reqs) if r.name != "gradsync"]
    for req in wanted:
        pin = pins.get(canonicalize_name(req.name))
        assert pin is not None and req.specifier.contains(pin), (str(req), pin)
    # a training run's dependencies only; the rest are extras, each one line when missing
    assert sorted(Requirement(r).name for r in project["dependencies"]) == [
        "hydra-core", "numpy", "omegaconf", "scikit-learn", "tensorboard", "torch", "tqdm"]
    assert project["optional-dependencies"]["all"] == [
        "gradsync[search,slurm,joblib,plots,hf,mlflow,wandb]"]
    assert "hydra-optuna-sweeper" not in pins
    torch = next(r for r in wanted if r.name == "torch")
    assert all(torch.specifier.contains(v) for v in ("2.11.0", "2.13.0"))
    assert pins["torch"] == "2.13.0"


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_optimizer_fused_builds_torchs_fused_kernel_with_sgds_same_bits(opt):
    from gradsync.models import MLP

    params = {}
    for fused in (None, True):
        cfg = compose_plain([f"optimizer={opt}"] + (["optimizer.fused=true"] if fused else []))
        preflight(cfg)
        torch.manual_seed(0)
        model = MLP(8, 4, [16], "tanh")
        optim = build_optimizer(cfg["optimizer"], model, model.parameters())
        assert optim.defaults["fused"] == fused
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            for q in model.parameters():
                q.grad = torch.randn(q.shape, generator=g)
            optim.step()
        params[fused] = torch.cat([q.detach().flatten() for q in model.parameters()])
    moved = (params[True] - params[None]).abs().max()
    if opt == "sgd":
        assert moved == 0  # the same bits: fused is a free speed-up for SGD
    else:
        assert moved < 1e-6


# --- errors name the component actually composed (issue 21) ---------------------------------
EXAMPLE = Path(CONF_DIR).parent / "examples" / "cnn_digits"
TESTS = Path(__file__).parent


CNN_KEYS = "model.chanels: unknown key for digits_cnn.model.SmallCNN; accepted keys: channels"
NAMED = [
    (EXAMPLE, ["--config-dir", "conf", "experiment=cnn", "model.chanels=8"], CNN_KEYS),
    (EXAMPLE, ["--config-dir", "conf", "model=cnn", "data=digit_images", "model.chanels=8"],
     CNN_KEYS),
    (TESTS, ["experiment=lm_accum_sweep", "model.foo=1"],
     "model.foo: unknown key for gradsync.models.Transformer; accepted keys: d_model, "
     "mlp_ratio, n_heads, n_layers"),
    (TESTS, ["sync=always", "sync.foo=1"],
     "sync.foo: unknown key for gradsync.sync.policies.AlwaysSync, which takes no keys"),
    # a keyword the target takes that its YAML does not list: Hydra needs the '+'
    (TESTS, ["optimizer.dampening=0.1"],
     "optimizer.dampening: not in the config of torch.optim.SGD, which takes it: add it with "
     "+optimizer.dampening=0.1"),
]


@pytest.mark.parametrize("cwd,argv,expected", NAMED, ids=[" ".join(a) for _, a, _ in NAMED])
def test_an_unknown_key_names_the_component_composed_and_its_keys(cwd, argv, expected, tmp_path,
                                                                   monkeypatch, capsys):
    """Through --config-dir, experiment presets and group choices: what Hydra composed, not
    what conf/<group>/<option>.yaml of the repo holds."""
    assert entry_point_error(argv, cwd, tmp_path, monkeypatch, capsys) == expected


# --- a _target_ that returns the wrong kind of object, refused before any worker starts -----
def with_nodes(**nodes) -> dict:
    cfg = compose_plain([])
    for group, node in nodes.items():
        cfg[group] = node
    return cfg


WRONG_KIND = [
    ({"model": {"_target_": "components_for_tests.not_a_model"}},
     "model (components_for_tests.not_a_model): returned a list, which is no torch.nn.Module"),
    ({"data": {"_target_": "components_for_tests.not_data"}},
     "data (components_for_tests.not_data): returned a dict, which is no "
     "gradsync.data.DataBundle"),
    ({"data": {"_target_": "components_for_tests.digits_lacking_a_size"}},
     "data (components_for_tests.digits_lacking_a_size): @provides names n_classes, which its "
     "DataBundle's sizes lack (they are in_dim, out_dim)"),
    ({"data": {"_target_": "components_for_tests.digits_without_eval"}},
     "data (components_for_tests.digits_without_eval): its DataBundle's eval set is empty"),
    ({"optimizer": {"_target_": "components_for_tests.list_optimizer", "_partial_": True}},
     "optimizer (components_for_tests.list_optimizer): returned a list, which is no "
     "torch.optim.Optimizer"),
    ({"lr_scheduler": {"_target_": "components_for_tests.no_scheduler"}},
     "lr_scheduler (components_for_tests.no_scheduler): returned None, which is no LR "
     "scheduler (it needs step, state_dict and load_state_dict)"),
    # the documented missing-size error for a size name of one's own
    ({"model": {"_target_": "components_for_tests.ImageModel"}},
     "model: components_for_tests.ImageModel needs image_size, which data "
     "(gradsync.data.digits) does not provide (it provides in_dim, out_dim)"),
]


@pytest.mark.parametrize("nodes,expected", WRONG_KIND, ids=[str(n) for n, _ in WRONG_KIND])
def test_a_component_returning_the_wrong_kind_of_object_is_refused(nodes, expected):
    with pytest.raises(ConfigError) as err:
        preflight(with_nodes(**nodes))
    assert str(err.value).startswith(expected), str(err.value)


def test_a_target_that_takes_no_keys_says_so_for_the_keys_left_from_another():
    """model._target_ replaced on the command line: the MLP's keys stay in the node."""
    with pytest.raises(ConfigError) as e:
        preflight(compose_plain(["model._target_=components_for_tests.not_a_model"]))
    assert str(e.value) == ("model.hidden_sizes: unknown key for "
                            "components_for_tests.not_a_model; it takes no keys")


RENAMED_MICRO = "data.micro_batch_size was renamed: use schedule.micro_batch_size"


@pytest.mark.parametrize("argv", [["data.micro_batch_size=8"], ["+data.micro_batch_size=8"]])
def test_the_old_micro_batch_key_names_the_new_one(argv, tmp_path, monkeypatch, capsys):
    assert entry_point_error(argv, TESTS, tmp_path, monkeypatch, capsys) == RENAMED_MICRO


def test_a_data_node_holding_the_micro_batch_is_refused_but_a_recorded_one_is_read():
    cfg = compose_plain(["schedule.micro_batch_size=8"])
    assert cfg["schedule"]["micro_batch_size"] == 8 and "micro_batch_size" not in cfg["data"]
    old = cfg | {"data": cfg["data"] | {"micro_batch_size": 32},
                 "schedule": {k: v for k, v in cfg["schedule"].items() if k != "micro_batch_size"}}
    with pytest.raises(ConfigError, match="^" + RENAMED_MICRO + "$"):
        preflight(old)
    # a config a checkpoint recorded before the rename: its micro-batch, its data's arguments
    run = RunConfig.from_plain(old)
    assert run.micro_batch_size == 32 and "micro_batch_size" not in run.data.args
    assert run.to_plain()["schedule"]["micro_batch_size"] == 32


def test_the_config_check_builds_nothing_and_the_preflight_builds_every_part():
    """config/validate.py checks the config's own values; a data target returning the wrong
    kind passes it, and the run's preflight (run/preflight.py) builds it and refuses it."""
    from gradsync.config.validate import validate

    cfg = with_nodes(data={"_target_": "components_for_tests.not_data"})
    run = validate(cfg, 2, "cpu")
    assert (run.data.target, run.micro_batch_size, run.schedule.window_size) == (
        "components_for_tests.not_data", 16, 4)
    with pytest.raises(ConfigError, match=r"^data \(components_for_tests.not_data\): returned a "
                                          r"dict, which is no gradsync.data.DataBundle"):
        preflight(cfg)


# Each renamed option (config/renames.py RENAMED): the choices it needs and a value for it.
RENAMED_CASES = {
    "data.micro_batch_size": ([], "8"),
    "schedule.every": (["schedule=adaptive"], "8"),
    "trainer.engine": ([], "fsdp"),
    "trainer.fsdp_units": ([], "blocks.*"),
    "trainer.replicas": ([], "2"),
    "trainer.bucket_cap_mb": ([], "1.0"),
    "trainer.gradient_as_bucket_view": ([], "false"),
    "trainer.allreduce": ([], "process_group"),
    "trainer.find_unused_parameters": ([], "true"),
    "trainer.sync_batchnorm": ([], "true"),
    "trainer.trace_sync": ([], "true"),
    "trainer.compile": ([], "true"),
    "trainer.compile_backend": ([], "aot_eager"),
    "trainer.compile_mode": ([], "default"),
    "trainer.compile_dynamic": ([], "false"),
    "trainer.noise_scale": ([], "true"),
    "trainer.noise_scale_decay": ([], "0.9"),
    **WINDOW_CASES,  # the window's size and the cadences' units (tests/test_renames.py)
}


def test_every_renamed_option_has_a_case():
    assert set(RENAMED_CASES) == set(RENAMED)


@pytest.mark.parametrize("old", sorted(RENAMED_CASES))
def test_a_renamed_option_answers_its_old_name_with_the_new_one(old, tmp_path, monkeypatch,
                                                                 capsys):
    """An old name, as an override, from a YAML file of one's own, or in a composed config:
    one line naming the new name, exit 2, nothing started."""
    choices, value = RENAMED_CASES[old]
    expected = f"{old} was renamed: use {RENAMED[old]}"
    assert entry_point_error([*choices, f"{old}={value}"], tmp_path, tmp_path, monkeypatch,
                             capsys) == expected
    with pytest.raises(ConfigError, match=f"^{re.escape(expected)}$"):
        compose_plain([*choices, f"{old}={value}"])
    # a preset of one's own that still sets the old name
    group, key = old.rsplit(".", 1)
    (tmp_path / "conf" / "experiment").mkdir(parents=True)
    (tmp_path / "conf" / "experiment" / "old.yaml").write_text(
        f"# @package _global_\n{group}:\n  {key}: {value}\n")
    assert entry_point_error(["--config-dir", "conf", *choices, "experiment=old"], tmp_path,
                             tmp_path / "x", monkeypatch, capsys) == expected
    # the composed config, as validate() gets it (a component's key passes Hydra's schema)
    plain = compose_plain(choices)
    node = plain
    for part in group.split("."):
        node = node[part]
    node[key] = yaml.safe_load(value)
    with pytest.raises(ConfigError, match=f"^{re.escape(expected)}$"):
        preflight(plain)


def test_an_option_an_extra_provides_is_one_line_naming_the_extra(monkeypatch):
    """hydra/launcher=joblib, slurm, slurm_local without their Hydra plugins (gradsync[joblib],
    gradsync[slurm]): Hydra's missing option, named with the extra to install."""
    import importlib.util

    from hydra.errors import MissingConfigException

    from gradsync.config.errors import one_line

    def missing(where: str) -> MissingConfigException:
        return MissingConfigException("not found", missing_cfg_file=where, options=["basic"])

    assert one_line(missing("hydra/launcher/joblib")).startswith(
        "hydra/launcher=joblib: no such option")  # installed: another cause, said as it is
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name.startswith(
        ("hydra_plugins.hydra_joblib", "hydra_plugins.hydra_submitit")) else find_spec(name, *a))
    assert one_line(missing("hydra/launcher/joblib")) == (
        "hydra/launcher=joblib needs hydra-joblib-launcher: pip install 'gradsync[joblib]'")
    assert one_line(missing("hydra/launcher/submitit_slurm")) == (
        "hydra/launcher=slurm needs hydra-submitit-launcher: pip install 'gradsync[slurm]'")
    assert one_line(missing("hydra/launcher/submitit_local")) == (
        "hydra/launcher=slurm_local needs hydra-submitit-launcher: pip install "
        "'gradsync[slurm]'")
    assert one_line(missing("model/cnn")) == "model=cnn: no such option; choose one of: basic"


@pytest.mark.parametrize("args,expected", [
    (["data=stdlib_text", "model=transformer", "data.root=???"],
     "data.root: missing (??? in the config): gradsync.data.corpus.stdlib_text takes a string, "
     "or null; set it, e.g. data.root=..."),
    (["trainer.devices=???"], "trainer.devices: missing (??? in the config): it takes an "
     "integer; set it, e.g. trainer.devices=..."),
    (["+data.data_dir=???"], "data.data_dir: missing (??? in the config): set it, e.g. "
     "data.data_dir=..."),
])
def test_a_mandatory_value_left_unset_names_its_full_key_and_type(args, expected):
    """A YAML's ??? left unset: the full key (not OmegaConf's `data_dir`) and what it takes."""
    with pytest.raises(ConfigError) as e:
        compose_plain(args)
    assert str(e.value) == expected
