"""--pipeline-model-parallel-layout, --num-virtual-stages-per-pipeline-rank and --use-tp-pp-dp-mapping:
the parsed layouts, the rank groups (hand-computed from Megatron's RankGenerator rule), and gloo runs
that equal the one-rank run (losses, validation loss, every parameter after 3 steps)."""
import pytest

from paratron.config import ConfigError
from paratron.parallel.dims import initialize_model_parallel
from paratron.config.pipeline_split import expand, layout_counts
from paratron.parallel.stages import chunk_layers
from tests.parallel.common import tiny_config
from tests.parallel.test_pipeline import run_case, spawn_cases
from tests.parallel.test_pipeline import test_pipeline_equals_single_rank as check_case

CASES = {  # name -> (world, style, settings); BASE of test_pipeline: 4 layers, 8 micro-batches per step
    # VPP 2 from the layout, uneven chunks (1, 1, 2) and a loss-only last virtual stage
    "layout_v2_loss_stage": (2, "gpt", dict(pipeline_model_parallel_size=2,
                                            pipeline_model_parallel_layout="Et|t|tt|L")),
    # an embedding-only first stage (the tied output layer's copy on the last)
    "layout_embedding_stage": (2, "gpt", dict(pipeline_model_parallel_size=2, pipeline_model_parallel_layout="E|t*4L")),
    # DP outermost: rank 1 is pipeline stage 1 of replica 0
    "tp_pp_dp_mapping": (4, "gpt", dict(pipeline_model_parallel_size=2, use_tp_pp_dp_mapping=True)),
}


def test_layout_strings_expand_as_megatron():
    assert expand("Et*3|(tt|)*29,m|L") == ["Ettt"] + ["tt"] * 29 + ["m", "L"]
    assert expand("Et*2|(tt|)*5t|tmL") == ["Ett", "tt", "tt", "tt", "tt", "tt", "t", "tmL"]
    assert expand("(|ab)*2,cd".replace("a", "t").replace("b", "t").replace("c", "t").replace("d", "L")) == \
        ["", "tt", "tttL"]
    # stage s is virtual stage s // PP of rank s % PP; layers numbered in stage order
    assert layout_counts("Et|t|tt|L", 4, 2) == {(0, 0): 1, (0, 1): 1, (1, 0): 2, (1, 1): 0}
    assert chunk_layers(4, 2, 2, layout="Et|t|tt|L") == {(0, 0): (0, 1), (0, 1): (1, 1), (1, 0): (2, 2),
                                                         (1, 1): (4, 0)}


@pytest.mark.parametrize("settings,match", [
    (dict(pipeline_model_parallel_size=4, pipeline_model_parallel_layout="Et*2|(tt|)*5t|tmL", num_layers=14),
     "MTP layers"),
    (dict(pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Et|t|tL"), "not a multiple of"),
    (dict(pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Ett|tL"), "--num-layers is 4"),
    (dict(pipeline_model_parallel_size=2, pipeline_model_parallel_layout="tEt|ttL"), "E must open"),
    (dict(pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Ett|ttx"), "unknown layer letter 'x'"),
    (dict(pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Ett|ttL",
          decoder_first_pipeline_num_layers=1), "remove --decoder-first/last"),
    (dict(pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Ett|ttL",
          num_virtual_stages_per_pipeline_rank=1), "mutually exclusive"),
    (dict(pipeline_model_parallel_size=2, num_virtual_stages_per_pipeline_rank=3), "divisible by 3"),
])
def test_layout_errors(settings, match):
    with pytest.raises(ConfigError, match=match) as e:
        tiny_config("gpt", world_size=2, **dict(dict(num_layers=4), **settings))
    assert "\n" not in str(e.value)


def test_virtual_stages_per_rank_is_the_virtual_size():
    cfg = tiny_config("gpt", world_size=2, num_layers=4, pipeline_model_parallel_size=2,
                      num_virtual_stages_per_pipeline_rank=2)
    assert cfg.parallel.virtual_pipeline_model_parallel_size == 2  # the pp2_virtual2 case of test_pipeline.py
    assert tiny_config("gpt", world_size=2, num_layers=4, pipeline_model_parallel_size=2,
                       pipeline_model_parallel_layout="Ett|ttL").parallel.virtual_pipeline_model_parallel_size == 1


def groups(world, rank, **sizes):
    return initialize_model_parallel(order="tp-cp-ep-pp-dp", world_size=world, rank=rank, **sizes).group_ranks


def test_tp_pp_dp_groups_equal_megatrons():
    # 8 = TP2 x PP2 x DP2, rank = tp + 2 pp + 4 dp (Megatron's docstring example: dp groups [0,4],[1,5],...)
    g = groups(8, 5, tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    assert g["tp"] == [4, 5] and g["pp"] == [5, 7] and g["dp"] == [1, 5] and g["mp"] == [4, 5, 6, 7]
    assert g["embedding"] == [5, 7]
    # 12 = TP2 x PP3 x DP2, rank = tp + 2 pp + 6 dp
    g = groups(12, 9, tensor_model_parallel_size=2, pipeline_model_parallel_size=3)
    assert g["pp"] == [7, 9, 11] and g["dp"] == [3, 9] and g["tp"] == [8, 9] and "embedding" not in g  # middle stage
    assert groups(12, 11, tensor_model_parallel_size=2, pipeline_model_parallel_size=3)["embedding"] == [7, 11]
    # 16 = TP2 x CP2 x PP2 x DP2, EP2 (expert layout tp-ep-pp-dp): the gpt3_mcore_tp2_cp2_pp2_ep2 test's layout
    g = groups(16, 6, tensor_model_parallel_size=2, pipeline_model_parallel_size=2, context_parallel_size=2,
               expert_model_parallel_size=2)
    assert g["cp"] == [4, 6] and g["pp"] == [2, 6] and g["dp"] == [6, 14] and g["dp_cp"] == [4, 6, 12, 14]
    assert g["tp_cp"] == [4, 5, 6, 7] and g["mp"] == [2, 3, 6, 7]
    assert g["ep"] == [4, 6] and g["edp"] == [6, 14] and g["etp"] == [6, 7] and g["emp"] == list(range(8))
    d = initialize_model_parallel(2, 2, order="tp-cp-ep-pp-dp", world_size=8, rank=6)
    assert (d.tp_rank, d.pp_rank, d.dp_rank) == (0, 1, 1)
    with pytest.raises(ConfigError, match="pipeline groups differ"):
        initialize_model_parallel(1, 2, expert_model_parallel_size=2, order="tp-cp-ep-pp-dp", world_size=8, rank=0)
    with pytest.raises(ConfigError, match="needs expert-TP 1 x EP 2 = TP 1"):
        tiny_config("gpt", world_size=8, pipeline_model_parallel_size=2, expert_model_parallel_size=2, num_experts=4,
                    use_tp_pp_dp_mapping=True)


def _ranks(rank, world, names):
    from paratron.train.loop import build_dims
    out = {}
    for name in names:
        out[name] = run_case(CASES[name][1], CASES[name][2])
        cfg = tiny_config(CASES[name][1], num_layers=4, **CASES[name][2])
        d = build_dims(cfg)
        out[name]["coords"] = (d.pp_rank, d.dp_rank)
    return out


@pytest.fixture(scope="module")
def reference():
    return {"gpt": run_case("gpt", {})}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return spawn_cases(CASES, _ranks, tmp_path_factory)


@pytest.mark.parametrize("name", list(CASES))
def test_layout_equals_single_rank(name, results, reference, monkeypatch):
    import tests.parallel.test_pipeline as tp
    monkeypatch.setattr(tp, "CASES", CASES)
    check_case(name, results, reference)
    chunks = [r["chunks"] for r in results[name]]
    assert chunks == ([2, 2] if name == "layout_v2_loss_stage" else [1] * len(chunks))
    if name == "tp_pp_dp_mapping":
        assert [r["coords"] for r in results[name]] == [(0, 0), (1, 0), (0, 1), (1, 1)]
