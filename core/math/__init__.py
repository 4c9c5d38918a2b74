"""The paper's math, pure tensors and no I/O: attention over the window and the memory in one
softmax (`attention`), rotary positions (`rope`), surprise and its threshold (`surprise`), and
boundary refinement with its graph metrics (`segmentation`). Imports nothing of emllm."""
