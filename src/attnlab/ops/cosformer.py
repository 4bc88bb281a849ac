"""(being written)"""


def cosformer_attention(*args, **kwargs):
    raise NotImplementedError
