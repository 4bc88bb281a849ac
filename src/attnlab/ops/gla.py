"""(being written)"""


def gla_attention(*args, **kwargs):
    raise NotImplementedError


def ssd_attention(*args, **kwargs):
    raise NotImplementedError
