"""How a step is spread over devices and in what precision.

    precision.py         mixed precision: the float32 SSM kernel and router under autocast, FSDP2's float32 units
    zero.py              DeepSpeed: the recipe's step settings and bf16 policy in its config, the ZeRO-3 model build
    context_parallel.py  one sequence split across processes: the layout of groups, the batch's chunks
    graphs.py            CUDA graphs for small models (train.compile_mode: reduce-overhead)
    compiled_loss.py     the language model's loss compiled with its blocks (regional compilation)
    fits.py              whether a model can train in this machine's memory, told from its config
"""
