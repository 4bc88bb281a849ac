"""(being written)"""


def principled_attention(*args, **kwargs):
    raise NotImplementedError
