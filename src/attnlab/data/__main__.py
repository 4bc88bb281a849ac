"""`python -m attnlab.data`: print the embedded corpus's files and byte-level tokens per split."""

from .corpus import describe_stdlib

print(describe_stdlib())
