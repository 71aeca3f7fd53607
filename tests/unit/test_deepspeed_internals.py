"""Every DeepSpeed internal megatron/deepspeed_internals.py touches still exists and behaves as that
module assumes (pinned DeepSpeed 0.19.8). A DeepSpeed upgrade that moves one fails here first."""

from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(scope="module")
def engine():  # type: ignore[no-untyped-def]
    """A one-rank fp32 DeepSpeed engine on gloo, the kind the trainer builds."""
    import deepspeed

    from single_rank import init_single_rank_gloo

    init_single_rank_gloo()
    model = torch.nn.Linear(4, 4)
    config = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
              "steps_per_print": 10**9}
    eng, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config)
    return eng


def test_shared_memory_op_cache_is_a_dict_deepspeed_consults() -> None:
    import deepspeed.ops

    from megatron.deepspeed_internals import skip_shared_memory_comm_op

    assert isinstance(deepspeed.ops.__compatible_ops__, dict)
    skip_shared_memory_comm_op()
    assert deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] is False


def test_universal_flag_lives_on_the_engine_config(engine) -> None:  # type: ignore[no-untyped-def]
    from megatron.deepspeed_internals import universal_loading

    before = engine._config.load_universal_checkpoint
    with universal_loading(engine, True):
        assert engine._config.load_universal_checkpoint is True
    assert engine._config.load_universal_checkpoint == before
    # DeepSpeed reads the flag through this accessor inside load_checkpoint
    assert engine.load_universal_checkpoint() == before


def test_fp32_clipping_hook_and_recorded_norm(engine) -> None:  # type: ignore[no-untyped-def]
    from megatron.deepspeed_internals import replace_fp32_clipping

    assert callable(engine.clip_fp32_gradients)  # the method DeepSpeed calls at the step boundary
    replace_fp32_clipping(engine, lambda: 3.5)
    engine.clip_fp32_gradients()
    assert engine.get_global_grad_norm() == 3.5  # _global_grad_norm is what the public getter returns


def test_backward_allreduce_switch_is_honoured(engine) -> None:  # type: ignore[no-untyped-def]
    assert hasattr(engine, "enable_backward_allreduce")


def test_loss_scale_is_none_without_fp16(engine) -> None:  # type: ignore[no-untyped-def]
    from megatron.deepspeed_internals import loss_scale

    assert loss_scale(engine) is None


def test_loss_scale_attribute_of_deepspeeds_fp16_optimizers() -> None:
    """FP16_Optimizer and the ZeRO optimizers expose the current scale as `cur_scale`."""
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    for cls in (FP16_Optimizer, DeepSpeedZeroOptimizer):
        source = __import__("inspect").getsource(cls)
        assert "cur_scale" in source, cls


def test_checkpoint_engine_writes_through_save_and_makedirs(engine, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from megatron.deepspeed_internals import recorded_checkpoint_writes

    calls: list[str] = []
    ckpt_engine = engine.checkpoint_engine
    original = ckpt_engine.save

    def failing(state_dict, path):  # type: ignore[no-untyped-def]
        calls.append(path)
        raise OSError("disk full")

    ckpt_engine.save = failing
    try:
        with recorded_checkpoint_writes(engine) as errors:
            engine.save_checkpoint(str(tmp_path), "tag", save_latest=False)
    finally:
        ckpt_engine.save = original
    assert calls, "DeepSpeed no longer writes through checkpoint_engine.save"
    assert errors and "disk full" in str(errors[0])
    assert engine.checkpoint_engine.save == original


def test_model_parallel_rng_tracker_name_is_registered_by_our_seed() -> None:
    from deepspeed.runtime.activation_checkpointing import checkpointing

    from megatron.deepspeed_internals import model_parallel_rng_tracker_name

    assert model_parallel_rng_tracker_name() == checkpointing._MODEL_PARALLEL_RNG_TRACKER_NAME
    assert isinstance(model_parallel_rng_tracker_name(), str)


def test_shared_step_tensors_are_untied_so_each_group_counts_once() -> None:
    from types import SimpleNamespace

    from megatron.deepspeed_internals import untie_optimizer_steps

    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.Adam([{"params": [a]}, {"params": [b], "weight_decay": 0.0}], lr=0.1)
    shared = torch.tensor(4.0)  # what DeepSpeed 0.19.8's ZeRO-3 universal loader leaves behind
    for param in (a, b):
        optimizer.state[param] = {"step": shared, "exp_avg": torch.zeros_like(param),
                                  "exp_avg_sq": torch.zeros_like(param)}
    untie_optimizer_steps(SimpleNamespace(optimizer=SimpleNamespace(optimizer=optimizer)))
    a.grad, b.grad = torch.ones(3), torch.ones(2)
    optimizer.step()
    assert [float(optimizer.state[p]["step"]) for p in (a, b)] == [5.0, 5.0]  # tied, the one counter reads 6.0


def test_pipeline_tied_gradient_reduction_reads_every_tied_weight_grad() -> None:
    """skip_frozen_tied_gradients (LoRA) wraps this method: DeepSpeed all-reduces ``weight.grad`` of
    every tied weight, which a frozen weight does not have."""
    import inspect

    from deepspeed.pipe import PipelineModule

    source = inspect.getsource(PipelineModule.allreduce_tied_weight_gradients)
    assert "weight.grad" in source
    assert callable(PipelineModule.get_tied_weights_and_groups)


def test_pipeline_eval_adds_outputs_into_the_training_loss_total() -> None:
    """separate_pipeline_loss_total (LoRA reference pass) relies on: train_batch starts total_loss from
    None, and every forward on the last stage adds its loss_fn output into it."""
    import inspect

    from deepspeed.runtime.pipe.engine import PipelineEngine

    assert "self.total_loss = None" in inspect.getsource(PipelineEngine.train_batch)
    assert "self.total_loss = add_to_total_loss(self.total_loss" in inspect.getsource(PipelineEngine._exec_forward_pass)
    assert "self.total_loss = None" not in inspect.getsource(PipelineEngine.eval_batch)


def test_gradient_allreduce_wrapper_is_what_backward_calls(engine) -> None:  # type: ignore[no-untyped-def]
    """engine/moe.py reduces expert gradients inside the wrapper: the plain engine's backward and
    the pipeline engine's reduce step must both go through ``engine.allreduce_gradients``."""
    import inspect

    from deepspeed.runtime.pipe.engine import PipelineEngine

    from megatron.deepspeed_internals import wrap_gradient_allreduce

    calls: list[str] = []

    def around(original):  # type: ignore[no-untyped-def]
        def wrapped(*args, **kwargs):  # type: ignore[no-untyped-def]
            calls.append("reduce")
            return original(*args, **kwargs)
        return wrapped

    enabled = engine.enable_backward_allreduce
    engine.enable_backward_allreduce = True
    wrap_gradient_allreduce(engine, around)
    try:
        loss = engine(torch.ones(2, 4)).sum()
        engine.backward(loss)
        engine.step()
    finally:
        del engine.allreduce_gradients  # the class's method again
        engine.enable_backward_allreduce = enabled
    assert calls == ["reduce"]
    assert "self.allreduce_gradients(" in inspect.getsource(PipelineEngine._exec_reduce_grads)


def test_the_model_step_runs_at_the_boundary_before_the_update(engine) -> None:  # type: ignore[no-untyped-def]
    """engine/build.py sums partial tensor-parallel gradients in ``before_optimizer_step``: the plain
    and the pipeline engine both take their optimizer step through ``_take_model_step``, after the
    data-parallel reduction and before clipping and the update, and (no ZeRO) the reduced gradient is
    ``param.grad``; ZeRO-1/2's and the bf16 optimizer's are where ``safe_get_full_grad`` reads them."""
    import inspect

    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.pipe.engine import PipelineEngine
    from deepspeed.utils import safe_get_full_grad
    from deepspeed.utils.tensor_fragment import tensor_fragment

    from megatron.deepspeed_internals import before_optimizer_step, reduced_gradients

    seen: list[list[torch.Tensor]] = []
    weight = engine.module.weight
    before = weight.detach().clone()
    before_optimizer_step(engine, lambda: seen.append([g.clone() for g in reduced_gradients([weight])]))
    try:
        engine.backward(engine(torch.ones(2, 4)).sum())
        engine.step()
    finally:
        del engine._take_model_step  # the class's method again
    assert len(seen) == 1 and len(seen[0]) == 1 and seen[0][0].abs().sum() > 0  # the gradient, before the update
    assert not torch.equal(weight.detach(), before)  # and the step still ran
    assert "self._take_model_step(" in inspect.getsource(DeepSpeedEngine.step)
    assert "self._take_model_step(" in inspect.getsource(PipelineEngine._exec_optimizer_step)
    step = inspect.getsource(DeepSpeedEngine._take_model_step)
    assert step.index("clip_fp32_gradients") < step.index("self.optimizer.step()")
    reader = inspect.getsource(safe_get_full_grad)
    assert reader.index("'_hp_grad'") < reader.index("param.grad is not None") < reader.index("'_hp_mapping'")
    assert "lp._hp_grad = hp_grad" in inspect.getsource(BF16_Optimizer._update_hp_grad)
    assert "def get_lp_grad_fragment(self, index_in_param_group)" in inspect.getsource(tensor_fragment)


def test_engine_timer_group_and_pipeline_backward_timer_lists(engine) -> None:  # type: ignore[no-untyped-def]
    from deepspeed.runtime.engine import EngineTimers
    from deepspeed.utils.timer import SynchronizedWallClockTimer

    from megatron.deepspeed_internals import collect_engine_timers

    def quiet(*_args, **_kwargs) -> None:  # type: ignore[no-untyped-def]
        return None

    assert callable(SynchronizedWallClockTimer.log)  # what the instance attribute shadows
    group = collect_engine_timers(engine, quiet)
    try:
        assert group is engine.timers and isinstance(group, SynchronizedWallClockTimer)
        assert group.log is quiet
    finally:
        del group.log
    timers = EngineTimers(enable_micro_timers=True, enable_global_timers=True)
    assert timers.backward_timers and timers.backward_inner_timers  # the lists a pipeline run empties
    assert isinstance(engine.engine_timers, EngineTimers)


def test_engine_counters_are_the_checkpoint_keys_deepspeed_writes(engine) -> None:  # type: ignore[no-untyped-def]
    import inspect

    from deepspeed.runtime.engine import DeepSpeedEngine

    from megatron.deepspeed_internals import restore_engine_counters

    saved = (engine.global_steps, engine.global_samples, engine.skipped_steps)
    try:
        restore_engine_counters(engine, {"global_steps": 7, "global_samples": 14})
        assert (engine.global_steps, engine.global_samples, engine.skipped_steps) == (7, 14, saved[2])
    finally:
        engine.global_steps, engine.global_samples, engine.skipped_steps = saved
    source = inspect.getsource(DeepSpeedEngine._common_checkpoint_state)
    assert all(f"{key}=self.{key}" in source for key in ("global_steps", "global_samples", "skipped_steps"))


def test_partitioned_optimizer_state_markers_are_what_deepspeed_reads() -> None:
    import inspect

    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    from deepspeed.utils import safe_get_full_optimizer_state

    from megatron.deepspeed_internals import has_partitioned_optimizer_state, relink_optimizer_state_views

    reader = inspect.getsource(safe_get_full_optimizer_state)
    assert "hasattr(param, 'ds_id')" in reader and "hasattr(param, '_hp_mapping')" in reader
    plain = torch.nn.Parameter(torch.ones(2))
    assert not has_partitioned_optimizer_state(plain)
    plain._hp_mapping = None  # type: ignore[attr-defined]  # how ZeRO-1/2 marks a linked parameter
    assert has_partitioned_optimizer_state(plain)
    for cls in (DeepSpeedZeroOptimizer, BF16_Optimizer):
        lazy = inspect.getsource(cls._lazy_init_hp_params_optimizer_state)
        assert "if not self._hp_optimizer_states_linked:" in lazy, cls
    assert relink_optimizer_state_views(torch.optim.SGD([plain], lr=0.1)) is False  # nothing to relink


def test_relinking_clears_the_guard_and_links_again() -> None:
    from types import SimpleNamespace

    from megatron.deepspeed_internals import relink_optimizer_state_views

    linked: list[bool] = []
    optimizer = SimpleNamespace(_hp_optimizer_states_linked=True)
    optimizer._lazy_init_hp_params_optimizer_state = lambda: linked.append(optimizer._hp_optimizer_states_linked)
    assert relink_optimizer_state_views(optimizer) is True
    assert linked == [False]  # the guard was down when DeepSpeed's linker ran


def test_pipeline_module_layer_bookkeeping(engine) -> None:  # type: ignore[no-untyped-def]
    """checkpointing/neox/files.py writes GPT-NeoX's layer files through these: the stage's first spec index, the
    grid placing the files, the tied-weight sync and the engine's calls into save/load."""
    import inspect

    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.engine import PipelineEngine

    from megatron.deepspeed_internals import (
        pipeline_grid,
        pipeline_local_start,
        replace_pipeline_layer_io,
        synchronize_tied_weights,
    )

    module = PipelineModule(layers=[torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)], num_stages=1)
    assert pipeline_local_start(module) == 0
    assert pipeline_grid(module).data_parallel_id == 0
    assert pipeline_grid(module).get_slice_parallel_rank() == 0
    synchronize_tied_weights(module)  # no tied weights: a no-op that must still exist
    assert "self._local_start = start" in inspect.getsource(PipelineModule._set_bounds)
    calls: list[str] = []
    replace_pipeline_layer_io(module, save=lambda *a, **k: calls.append("save"),
                              load=lambda *a, **k: calls.append("load"))
    module.save_state_dict("dir", None)
    module.load_state_dir("dir", None)
    assert calls == ["save", "load"]
    assert "self.module.save_state_dict(" in inspect.getsource(PipelineEngine.module_state_dict)
    assert "self.module.load_state_dir(" in inspect.getsource(PipelineEngine.load_module_state_dict)


def test_module_state_dict_conversion_runs_in_save_and_load_checkpoint(engine, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from megatron.deepspeed_internals import convert_module_state_dicts

    def on_save(weights):  # type: ignore[no-untyped-def]
        return {f"renamed.{k}": v for k, v in weights.items()}

    def on_load(checkpoint):  # type: ignore[no-untyped-def]
        seen.append(sorted(checkpoint["module"]))
        return {**checkpoint, "module": {k.removeprefix("renamed."): v for k, v in checkpoint["module"].items()}}

    seen: list[list[str]] = []
    convert_module_state_dicts(engine, on_save=on_save, on_load=on_load)
    try:
        engine.save_checkpoint(str(tmp_path), "converted", save_latest=False)
        saved = torch.load(tmp_path / "converted" / "mp_rank_00_model_states.pt", weights_only=False)
        assert sorted(saved["module"]) == ["renamed.bias", "renamed.weight"]
        engine.load_checkpoint(str(tmp_path), "converted")
    finally:
        del engine.module_state_dict, engine.load_module_state_dict  # the class's methods again
    assert seen == [["renamed.bias", "renamed.weight"]]


def test_the_directory_being_loaded_is_known_to_the_module_hook(engine, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``load_checkpoint(load_dir, tag)`` is what calls ``load_module_state_dict`` (neox/files.py reads
    the format of the files it converts from ``load_dir/tag``)."""
    from megatron.deepspeed_internals import checkpoint_being_loaded, convert_module_state_dicts

    loading = checkpoint_being_loaded(engine)
    seen: list[object] = []
    convert_module_state_dicts(engine, on_save=lambda w: w, on_load=lambda c: seen.append(loading()) or c)
    try:
        engine.save_checkpoint(str(tmp_path), "tag7", save_latest=False)
        assert loading() is None
        engine.load_checkpoint(str(tmp_path), "tag7")
    finally:
        del engine.module_state_dict, engine.load_module_state_dict, engine.load_checkpoint
    assert seen == [str(tmp_path / "tag7")] and loading() is None


@pytest.fixture()
def zero3_engine(engine):  # type: ignore[no-untyped-def]
    """A one-rank ZeRO-3 engine (``engine`` has set up the process group), plain SGD."""
    import deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))
    config = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
              "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True}
    eng, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config)
    yield eng
    eng.destroy()


def _zero3_weights(eng) -> list[float]:  # type: ignore[no-untyped-def]
    return [float(x) for p in eng.module.parameters() for x in p.ds_tensor.flatten()]


def test_zero3_gradient_partitions_are_what_its_step_reads(zero3_engine) -> None:  # type: ignore[no-untyped-def]
    from megatron.deepspeed_internals import reduce_zero3_gradients_before_step

    seen: list[int] = []

    def zero_out(buffer: torch.Tensor) -> None:
        seen.append(buffer.numel())
        buffer.zero_()  # a reduction the step must see: no gradient, no update

    reduce_zero3_gradients_before_step(zero3_engine.optimizer, zero_out)
    before = _zero3_weights(zero3_engine)
    zero3_engine.backward(zero3_engine(torch.randn(2, 4)).pow(2).mean())
    zero3_engine.step()
    assert seen == [sum(p.ds_tensor.numel() for p in zero3_engine.module.parameters())]
    assert _zero3_weights(zero3_engine) == before
    # and the buffer really carries the gradients: without the reduction the same step moves the weights
    zero3_engine.optimizer.step = type(zero3_engine.optimizer).step.__get__(zero3_engine.optimizer)
    zero3_engine.backward(zero3_engine(torch.randn(2, 4)).pow(2).mean())
    zero3_engine.step()
    assert _zero3_weights(zero3_engine) != before


def test_zero_pending_gradients_are_what_its_norm_reads(zero3_engine) -> None:  # type: ignore[no-untyped-def]
    """before_zero_step runs before ZeRO's step with every parameter's reduced gradient part: their norm is the
    global norm DeepSpeed then takes (before its clipping), so none is missing, doubled or scaled."""
    from megatron.deepspeed_internals import before_zero_step, zero_pending_gradients

    seen: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
    before_zero_step(zero3_engine.optimizer, lambda: seen.append(zero_pending_gradients(zero3_engine.optimizer)))
    zero3_engine.backward(zero3_engine(torch.randn(2, 4)).pow(2).mean())
    zero3_engine.step()
    zero3_engine.optimizer.step = type(zero3_engine.optimizer).step.__get__(zero3_engine.optimizer)
    (pairs,) = seen
    assert [id(p) for p, _ in pairs] == [id(p) for p in zero3_engine.module.parameters()]
    norm = sum(float(g.double().pow(2).sum()) for _, g in pairs) ** 0.5
    assert norm > 0 and abs(norm - float(zero3_engine.get_global_grad_norm())) <= 1e-5 * norm
    assert zero_pending_gradients(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)) == []


def test_checkpoint_write_flags_decide_deepspeeds_files(zero3_engine, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from megatron.deepspeed_internals import skip_checkpoint_writes

    assert zero3_engine.save_non_zero_checkpoint and zero3_engine.save_zero_checkpoint  # set per rank at init
    zero3_engine.save_checkpoint(str(tmp_path / "written"), "tag")
    assert sorted(p.name for p in (tmp_path / "written" / "tag").glob("*.pt")) == [
        "zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    skip_checkpoint_writes(zero3_engine)
    zero3_engine.save_checkpoint(str(tmp_path / "skipped"), "tag")
    assert list((tmp_path / "skipped").rglob("*.pt")) == []


def test_without_optimizer_state_leaves_the_optimizer_files_and_entries_out(engine, zero3_engine,  # type: ignore[no-untyped-def]
                                                                              tmp_path) -> None:
    """no_save_optim: the model-states file's optimizer/lr_scheduler entries (``_common_checkpoint_state``) are None
    and the ZeRO optimizer files (``save_zero_checkpoint``) are not written; both are put back afterwards."""
    from megatron.deepspeed_internals import without_optimizer_state

    engine.save_checkpoint(str(tmp_path / "full"), "tag")
    with without_optimizer_state(engine):
        engine.save_checkpoint(str(tmp_path / "weights"), "tag")
    full = torch.load(tmp_path / "full" / "tag" / "mp_rank_00_model_states.pt", weights_only=False)
    weights = torch.load(tmp_path / "weights" / "tag" / "mp_rank_00_model_states.pt", weights_only=False)
    assert full["optimizer"] is not None and weights["optimizer"] is None and weights["lr_scheduler"] is None
    assert all(torch.equal(weights["module"][k], v) for k, v in full["module"].items())
    assert "_common_checkpoint_state" not in vars(engine)  # the class's method again
    flag = zero3_engine.save_zero_checkpoint
    with without_optimizer_state(zero3_engine):
        zero3_engine.save_checkpoint(str(tmp_path / "zero3"), "tag")
    assert not list((tmp_path / "zero3" / "tag").glob("*optim_states.pt")) and zero3_engine.save_zero_checkpoint == flag


def test_pipeline_step_line_is_a_print_in_its_module_and_is_filtered(capsys: pytest.CaptureFixture[str]) -> None:
    """quiet_step_line: the pipeline engine prints its step line with the module-global ``print``
    (which a module attribute shadows), starting with ``steps: ``; only that line is dropped."""
    import inspect

    import deepspeed.runtime.pipe.engine as pipe_engine

    from megatron.deepspeed_internals import STEP_LINE_START, quiet_step_line

    source = inspect.getsource(pipe_engine.PipelineEngine.train_batch)
    assert f"log_str = f'{STEP_LINE_START}{{self.global_steps}}" in source and "print(log_str)" in source
    capsys.readouterr()  # whatever importing DeepSpeed's modules logged
    try:
        quiet_step_line(quiet=True)
        pipe_engine.print("steps: 10 loss: 6.0265 iter time (s): 0.1 samples/sec: 80.0")
        pipe_engine.print("something else")
        assert capsys.readouterr().out == "something else\n"
        quiet_step_line(quiet=False)  # deepy.py --verbose
        pipe_engine.print("steps: 20 loss: 5.9")
        assert capsys.readouterr().out == "steps: 20 loss: 5.9\n"
    finally:
        del pipe_engine.print


def _fresh_python(code: str) -> str:
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(repo), "DS_ACCELERATOR": "cpu"})
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()[-1]


def test_muon_module_compiles_at_import_unless_deferred() -> None:
    """The cost the deferral removes is real (DeepSpeed's Muon module imports TorchInductor), and
    with the deferral its kernels are the same functions, compiled by torch.compile on first call."""
    plain = _fresh_python("import sys, deepspeed.runtime.zero.muon.muon_optimizer\n"
                          "print('torch._inductor.compile_fx' in sys.modules)")
    assert plain == "True"
    deferred = _fresh_python(
        "import sys\n"
        "from megatron.deepspeed_internals import defer_muon_kernel_compiles\n"
        "defer_muon_kernel_compiles()\n"
        "import torch\n"
        "from deepspeed.runtime import compiler\n"
        "from deepspeed.runtime.zero.muon import original_muon as m\n"
        "from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam\n"
        "kernels = [m.muon_update, m.zeropower_via_newtonschulz5, m.zeropower_via_gram_newtonschulz]\n"
        "print(['torch._inductor.compile_fx' in sys.modules, compiler.compile() is torch.compile,\n"
        "       all(callable(k) and k.__wrapped__.__module__ == m.__name__ for k in kernels)])")
    assert deferred == "[False, True, True]"


def test_fp16_optimizers_masters_are_whole_views_the_step_updates(engine) -> None:  # type: ignore[no-untyped-def]
    """Without ZeRO DeepSpeed's fp16 optimizers (also bf16 without a pipeline) keep whole fp32 copies: the fused one
    in one flat buffer per group (a GPU's FusedAdam picks it; here with SGD), the unfused one per parameter. The
    slices are views of them that the step moves, the module's weights their rounding. ZeRO and the bf16 optimizer:
    tests/distributed/test_model_averaging_zero3.py."""
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    from megatron.deepspeed_internals import fp32_master_slices

    for cls in (FP16_Optimizer, FP16_UnfusedOptimizer):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)).bfloat16()
        params = list(model.parameters())
        optimizer = cls(torch.optim.SGD(params, lr=0.1), low_precision_dtype=torch.bfloat16)
        slices = fp32_master_slices(optimizer, params)
        held = [view for view, _, _ in slices]  # type: ignore[misc]
        assert [(start, group) for _, start, group in slices] == [(0, None)] * len(params), cls  # type: ignore[misc]
        if cls is FP16_Optimizer:
            flat = optimizer.fp32_groups_flat[0]
            assert all(v.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for v in held)
        model(torch.randn(5, 4).bfloat16()).float().pow(2).sum().backward()
        optimizer.step()
        for param, view in zip(params, held):
            assert view.dtype == torch.float32 and view.numel() == param.numel(), cls
            assert torch.equal(view.view(param.shape).bfloat16(), param.detach()), cls  # the step wrote both
            assert not torch.equal(view.view(param.shape), param.detach().float()), cls  # and they differ
    assert fp32_master_slices(torch.optim.SGD(params, lr=0.1), params) == [None] * len(params)  # no fp32 copy


def test_deepspeeds_flat_gathers_use_torchs_current_names(engine, recwarn) -> None:  # type: ignore[no-untyped-def]
    """Issue 42 item 17: DeepSpeed's comm backend picked torch's deprecated all_gather_into_tensor and
    reduce_scatter_tensor (a FutureWarning per rank in a tp2 pipeline); it gets their replacements, whose bodies
    the deprecated ones are, and gathers the same."""
    import inspect

    import deepspeed.comm as ds_comm
    import torch.distributed as dist
    from deepspeed.comm import comm

    from megatron.deepspeed_internals import use_current_collective_names

    for deprecated, current in (("all_gather_into_tensor", "all_gather_single"),
                                ("reduce_scatter_tensor", "reduce_scatter_single")):
        assert f"return {current}(" in inspect.getsource(getattr(dist, deprecated))  # the same collective
    comm.cdb.all_gather_function = comm.cdb.get_all_gather_function()  # what DeepSpeed picks when it starts
    comm.cdb.reduce_scatter_function = comm.cdb.get_reduce_scatter_function()
    assert comm.cdb.all_gather_function is dist.all_gather_into_tensor
    use_current_collective_names()
    use_current_collective_names()  # idempotent
    assert comm.cdb.all_gather_function is dist.all_gather_single
    assert comm.cdb.reduce_scatter_function is dist.reduce_scatter_single
    out, part = torch.zeros(3), torch.tensor([1.0, 2.0, 3.0])
    ds_comm.all_gather_into_tensor(out, part)
    reduced = torch.zeros(3)
    ds_comm.reduce_scatter_tensor(reduced, part * 2)
    assert torch.equal(out, part) and torch.equal(reduced, part * 2)  # one rank: its own
    assert not [w for w in recwarn if "deprecated" in str(w.message)]


def test_checkpoint_writes_go_where_a_background_save_sends_them(engine, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """checkpoint_writes_to: every file of one save reaches the given writer (none is written by the engine), with
    the engine's serialization setting; afterwards the engine writes through its own save again."""
    from megatron.deepspeed_internals import checkpoint_writes_to

    original = engine.checkpoint_engine.save
    seen: list[str] = []
    with checkpoint_writes_to(engine, lambda state_dict, path: seen.append(path)) as zipfile:  # DeepSpeed passes keywords
        engine.save_checkpoint(str(tmp_path), "tag", save_latest=False)
    assert isinstance(zipfile, bool) and seen
    assert not any((tmp_path / "tag").glob("*.pt")), "the engine wrote a file itself"
    assert engine.checkpoint_engine.save == original


def test_activation_checkpointing_state_is_restored_after_a_rehearsal_configures_it() -> None:
    """The rehearsal configures DeepSpeed's activation checkpointing as rank r of a fake world; the process keeps
    its own configuration afterwards (the documented-commands test rehearses in a pytest worker, whose later
    tests recompute blocks: they drew other dropout masks before this was undone)."""
    from deepspeed.runtime.activation_checkpointing import checkpointing

    from megatron.deepspeed_internals import activation_checkpointing_kept

    before = (checkpointing.mpu, checkpointing.PARTITION_ACTIVATIONS, checkpointing.num_layers,
              checkpointing.deepspeed_checkpointing_enabled)
    tracker_before = checkpointing.get_cuda_rng_tracker().get_states()

    class FakeMpu:
        def get_model_parallel_rank(self) -> int:
            return 3

        def get_model_parallel_world_size(self) -> int:
            return 8

        def get_model_parallel_group(self) -> None:
            return None

    with activation_checkpointing_kept():
        # what configure(mpu, partition_activations=True, num_checkpoints=7) sets (it needs a process group)
        checkpointing.mpu, checkpointing.PARTITION_ACTIVATIONS, checkpointing.num_layers = FakeMpu(), True, 7
        checkpointing.deepspeed_checkpointing_enabled = True
        checkpointing.get_cuda_rng_tracker().add("rehearsal-seed", 99)
        assert checkpointing.PARTITION_ACTIVATIONS and checkpointing.num_layers == 7
    after = (checkpointing.mpu, checkpointing.PARTITION_ACTIVATIONS, checkpointing.num_layers,
             checkpointing.deepspeed_checkpointing_enabled)
    assert after == before
    assert set(checkpointing.get_cuda_rng_tracker().get_states()) == set(tracker_before)


def test_zero_masters_locate_each_weight_and_zero3_params_held_keeps_them_whole(zero3_engine) -> None:  # type: ignore[no-untyped-def]
    """zero_masters (SOAP's and Muon's gather, whole_parameters.ZeroWhole) finds every ZeRO-3 weight at its offset in
    the flat fp32 partition; zero3_params_held (Sophia-H's probe) keeps the weights whole through a forward and a
    twice-differentiated backward, and DeepSpeed releases them again after."""
    import deepspeed

    from megatron.deepspeed_internals import zero3_params_held, zero_masters

    params = list(zero3_engine.module.parameters())
    masters = zero_masters(zero3_engine.optimizer)
    assert sorted(id(p) for m in masters for p in m.params) == sorted(id(p) for p in params)
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        whole = {id(p): p.detach().clone() for p in params}
    for m in masters:  # one rank: each piece is the whole weight
        assert m.stage3 and m.pieces == m.numels
        for p, offset, n, shape in zip(m.params, m.offsets, m.numels, m.shapes):
            assert torch.equal(m.flat[offset:offset + n].view(shape), whole[id(p)])
    assert zero_masters(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)) == []
    with zero3_params_held(params):
        loss = zero3_engine.module(torch.randn(2, 4)).pow(2).sum()
        grads = torch.autograd.grad(loss, params, create_graph=True)
        hz = torch.autograd.grad(sum(g.sum() for g in grads), params)
        assert all(p.numel() == p.ds_numel for p in params) and all(h.shape == p.shape for h, p in zip(hz, params))
    assert all(p.numel() == 0 for p in params)  # partitioned again
