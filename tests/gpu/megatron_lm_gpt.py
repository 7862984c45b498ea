"""The tiny GPT the Megatron-LM GPU runs train: ``pretrain_gpt.py`` flags shared by
``test_megatron_lm_gpu.py`` (megatron-core's local layers) and ``megatron_lm_te.py``
(transformer-engine's layers)."""


def flags(text: str) -> list[str]:
    return text.split()


def gpt(transformer_impl: str) -> list[str]:
    """A 2-layer, 256-wide GPT on mock data, bf16, the distributed optimizer, clip 1.0,
    dropout and the optional fusions off, one log line per iteration."""
    return flags(
        "--mock-data --tokenizer-type NullTokenizer --vocab-size 1024 --num-layers 2 "
        "--hidden-size 256 --num-attention-heads 4 --seq-length 128 "
        "--max-position-embeddings 128 --micro-batch-size 2 --lr 3e-4 --bf16 "
        f"--transformer-impl {transformer_impl} --log-interval 1 --eval-iters 0 "
        "--eval-interval 1000 --use-distributed-optimizer --clip-grad 1.0 --split 99,1,0 "
        "--no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion "
        "--no-rope-fusion --hidden-dropout 0 --attention-dropout 0 --seed 1234 "
        "--log-num-zeros-in-grad"
    )
