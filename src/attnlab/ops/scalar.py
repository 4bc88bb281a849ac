"""(being written)"""


def scalar_attention(*args, **kwargs):
    raise NotImplementedError


def hybrid_attention(*args, **kwargs):
    raise NotImplementedError
