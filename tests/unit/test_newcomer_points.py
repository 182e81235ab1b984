"""The smaller points of a newcomer's first hour (issue 48, item 6): every batch problem reported together,
--seq-length beyond --max-position-embeddings with RoPE, per-prompt random draws of one --seed,
`paratron tokenizer --help`, and a converted HF checkpoint that keeps its tokenizer."""
import pytest

from paratron.config import parse_args
from paratron.config.rules import ConfigProblems

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--mock-data", "--vocab-size", "128", "--train-iters", "2", "--lr", "1e-3"]


def test_batch_mistakes_are_reported_with_the_other_problems():
    flags = BASE + ["--num-attention-heads", "5", "--micro-batch-size", "4", "--global-batch-size", "10",
                    "--rampup-batch-size", "3", "4", "100"]
    with pytest.raises(ConfigProblems) as e:
        parse_args(flags, world_size=2)
    text = " ".join(e.value.problems)
    assert len(e.value.problems) == 4, e.value.problems
    assert "--num-attention-heads" in text and "not divisible by --micro-batch-size 4" in text
    assert "minus START 3" in text and "must be multiples of --micro-batch-size" in text


@pytest.mark.parametrize("kind", ["rope", "learned_absolute"])
def test_seq_length_beyond_max_position_embeddings_is_refused_as_megatron_does(kind):
    flags = BASE + ["--position-embedding-type", kind, "--seq-length", "64"]
    with pytest.raises(ConfigProblems, match="--seq-length 64 exceeds --max-position-embeddings 32"):
        parse_args(flags)


def test_one_seed_gives_each_prompt_of_a_request_its_own_draws():
    from paratron.inference.engine import Engine
    from paratron.inference.sampling import SamplingParams
    from paratron.inference.text import TextModel
    from tests.unit.test_generate import VOCAB, tiny_model
    engine = Engine(tiny_model(), VOCAB)
    sp = SamplingParams(max_new_tokens=12, temperature=1.0, seed=7)
    prompt = [5, 6, 7, 8]
    batch = TextModel.requests(None, [prompt, prompt, prompt], sp)  # token-id prompts: no tokenizer needed
    tokens = [r.tokens for r in engine.generate(batch)]
    assert tokens[0] != tokens[1] and tokens[1] != tokens[2], tokens
    again = [r.tokens for r in engine.generate(TextModel.requests(None, [prompt, prompt, prompt], sp))]
    alone = engine.generate(TextModel.requests(None, [prompt], sp))[0].tokens
    later = engine.generate(TextModel.requests(None, [prompt], sp, first=1))[0].tokens
    assert again == tokens and alone == tokens[0] and later == tokens[1]  # reproducible, batch-independent


def test_tokenizer_help_exits_0(capsys):
    from paratron.cli import main
    with pytest.raises(SystemExit) as e:  # argparse's --help
        main(["tokenizer", "--help"])
    assert e.value.code == 0 and "--vocab-size" in capsys.readouterr().out


def test_convert_from_hf_keeps_the_tokenizer_so_the_checkpoint_serves(tmp_path):
    transformers = pytest.importorskip("transformers")
    import shutil
    from paratron.checkpoint.convert import main as convert
    from paratron.data.bpe_train import train_bpe_tokenizer
    from paratron.inference.load import load_for_inference
    (tmp_path / "corpus.txt").write_text("def f(x):\n    return x + 1\n" * 40)
    tok = train_bpe_tokenizer([str(tmp_path / "corpus.txt")], 300, str(tmp_path / "tok" / "tokenizer.json"))
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=300, max_position_embeddings=64)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "hf")
    shutil.copy(tok, tmp_path / "hf" / "tokenizer.json")
    assert convert(["--from", "hf", "--input", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt"), "--quiet"]) == 0
    assert (tmp_path / "ckpt" / "tokenizer" / "tokenizer.json").is_file()
    shutil.rmtree(tmp_path / "hf")  # the checkpoint stands alone
    loaded = load_for_inference(tmp_path / "ckpt")
    assert loaded.tokenizer is not None and loaded.tokenizer.detokenize(loaded.tokenizer.tokenize("def f")) == "def f"


def test_a_long_evaluation_is_announced_before_it_runs():
    from types import SimpleNamespace
    from paratron.train.evaluation import Evaluation
    said = []
    trainer = SimpleNamespace(cfg=SimpleNamespace(train=SimpleNamespace(eval_iters=100)),
                              log=SimpleNamespace(print=said.append))
    Evaluation._announce_long_evaluation(trainer, 0.5)  # 100 steps of 0.5 s
    Evaluation._announce_long_evaluation(trainer, 0.01)  # 1 s: no line
    assert said == [" evaluating 100 steps (--eval-iters 100), about 50 s ..."]


def test_demo_logs_often_on_cpu_and_names_only_files_it_wrote(tmp_path):
    from types import SimpleNamespace
    from paratron.demo import log_interval, written
    assert log_interval(500, on_gpu=False) == 10 and log_interval(1500, on_gpu=True) == 125
    cfg = SimpleNamespace(ckpt=SimpleNamespace(save=str(tmp_path / "ck")),
                          log=SimpleNamespace(tensorboard_dir=str(tmp_path / "tb")))
    assert written(cfg, {"plot": None}) == []  # stopped before its first log line: no plot, no checkpoint
    (tmp_path / "ck" / "iter_0000010").mkdir(parents=True)
    (tmp_path / "tb").mkdir()
    lines = written(cfg, {"plot": tmp_path / "loss.png"})
    assert [x.split(":")[0] for x in lines] == ["checkpoint", "tensorboard", "loss plot"]


def test_cpu_threads_default_is_the_cores_over_the_local_processes(monkeypatch):
    import os
    from paratron.train.distributed import cpu_threads
    cores = len(os.sched_getaffinity(0))
    cfg = parse_args(BASE)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert cpu_threads(cfg) == cores
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(2 * cores))
    assert cpu_threads(cfg) == 1
    assert cpu_threads(parse_args(BASE + ["--cpu-threads", "3"])) == 3


def test_demo_config_resolves_with_its_tokenizer(tmp_path):
    from paratron.data.corpus import prepare_demo_data
    from paratron.demo import demo_config
    prefix, tok = prepare_demo_data(str(tmp_path / "data"), vocab_size=400, max_bytes=200_000)
    cfg = demo_config(tmp_path, prefix, tok, 20, on_gpu=False)
    assert cfg.data.vocab_size == 400 and cfg.log.log_interval == 1 and cfg.train.cpu_threads >= 1
