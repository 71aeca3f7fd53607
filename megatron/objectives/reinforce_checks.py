"""Before-launch checks of GPT-NeoX's online REINFORCE: the objective (``reinforce.py``), its rollouts
(``dataset_impl: online``, ``megatron/data/online_dataset.py``) and the weight server
(``megatron/training/weight_server.py``). What GPT-NeoX at ea7aefd8 cannot do either is refused with where its code
says so; what Deepy has not built is said to be."""

from __future__ import annotations

from megatron.config_rules import RuleContext, rule, zero_stage

_REINFORCE_KEYS = ("fp32_reinforce", "kl_impl", "kl_div_beta")
_ONLINE_KEYS = ("online_dataserver_ips", "online_dataserver_ports", "reinforce_leave_one_out")
_FILE_KEYS = ("data_path", "train_data_paths", "train_label_data_paths", "valid_data_paths", "test_data_paths",
              "train_urls", "use_dummy_dataset")


@rule
def reinforce_reads_online_rollouts(ctx: RuleContext) -> list[str]:
    """REINFORCE trains on rollouts only the online dataset provides, and the online dataset's rewards are read by
    REINFORCE only; the keys of each are read with it only."""
    reinforce, online = ctx.get("train_impl") == "reinforce", ctx.get("dataset_impl") == "online"
    problems = []
    if reinforce and not online:
        problems.append(f"{ctx.show('train_impl')} reads rollouts with rewards, which only dataset_impl: online "
                        f"provides (GPT-NeoX ea7aefd8 training.py:438-449 reads their reward and raw_reward): set "
                        f"dataset_impl: online ({ctx.show('dataset_impl')})")
    if online and not reinforce:
        problems.append(f"{ctx.show('dataset_impl')}: rollouts and their rewards are read by train_impl: reinforce "
                        f"only ({ctx.show('train_impl')})")
    if not reinforce:
        given = [ctx.show(key) for key in _REINFORCE_KEYS if ctx.given(key)]
        if given:
            problems.append(f"{', '.join(given)} are read by train_impl: reinforce only ({ctx.show('train_impl')}): "
                            "remove them")
    if not online:
        given = [ctx.show(key) for key in _ONLINE_KEYS if ctx.given(key)]
        if given:
            problems.append(f"{', '.join(given)} are read by dataset_impl: online only ({ctx.show('dataset_impl')}): "
                            "remove them")
    if online:
        files = [ctx.show(key) for key in _FILE_KEYS if ctx.given(key)]
        if files:  # GPT-NeoX's own reinforce example sets data paths that it does not read either
            ctx.warnings.append(f"{', '.join(files)}: not read with {ctx.show('dataset_impl')} (the samples are "
                                "the rollout servers')")
    return problems


@rule
def reinforce_layout(ctx: RuleContext) -> list[str]:
    """The layouts REINFORCE's loss and the online rollouts run on."""
    problems = []
    if ctx.get("train_impl") == "reinforce" and ctx.uses_pipeline_module:
        problems.append(f"{ctx.show('train_impl')} with {ctx.show('pipe_parallel_size')}: GPT-NeoX's pipeline "
                        "engine trains the plain language-model loss instead (ea7aefd8 training.py:465-475, "
                        "get_batch_pipe reads no reward); set pipe_parallel_size: 0")
    if ctx.get("dataset_impl") != "online":
        return problems
    if ctx.cp > 1:
        problems.append(f"{ctx.show('dataset_impl')} with {ctx.show('context_parallel_size')}: REINFORCE's loss "
                        "divides each row's sum by the micro-batch's counted tokens, which a context-parallel rank "
                        "sees only its piece of, and GPT-NeoX ea7aefd8 has no context parallelism to follow; use "
                        "context_parallel_size: 1 (model_parallel_size > 1 works: the ranks of a data shard share "
                        "its rollouts)")
    if ctx.get("train_epochs") and not ctx.get("train_iters"):
        problems.append(f"{ctx.show('train_epochs')} with {ctx.show('dataset_impl')}: rollouts have no epochs; "
                        "set train_iters")
    dp = ctx.dp
    for key in ("online_dataserver_ips", "online_dataserver_ports"):
        value = ctx.get(key)
        if isinstance(value, list) and dp is not None and len(value) < dp:
            problems.append(f"{ctx.show(key)} lists {len(value)} servers for {dp} data-parallel ranks (rank r reads "
                            "entry r): list one per rank, or give one value for all")
    return problems


@rule
def weight_server_layout(ctx: RuleContext) -> list[str]:
    """Where the weight server can hand out whole weights, one port per rank."""
    if not ctx.get("serve_model_weights"):
        return [f"{ctx.show('weight_server_port')} is read with serve_model_weights: true only: remove it"
                ] if ctx.given("weight_server_port") else []
    problems = []
    if zero_stage(ctx) == 3:
        problems.append(f"{ctx.show('serve_model_weights')} with ZeRO stage 3: each rank holds a partition of every "
                        "weight and its state_dict() empty placeholders, so there is nothing whole to hand out "
                        "(GPT-NeoX serves state_dict() too); use ZeRO stage 0-2")
    ports = ctx.get("weight_server_port")
    if isinstance(ports, list) and len(ports) < ctx.world_size:
        problems.append(f"{ctx.show('weight_server_port')} lists {len(ports)} ports for {ctx.world_size} ranks "
                        "(rank r serves on entry r): list one per rank, or give one port (rank r serves on port + r)")
    return problems
