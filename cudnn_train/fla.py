"""FLA drop-in: accelerate_fla() rebinds FLA's ops to cudnn_train's dispatchers (see the linear-attention issue)."""
