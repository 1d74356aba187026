"""`python -m fp8attn.train ...` = `python -m fp8attn.train.compare ...`."""
from .compare import main

main()
