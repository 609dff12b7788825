"""Generation runtime: sampling, the decode engine, CUDA-graph replay."""
