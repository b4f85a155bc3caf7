"""cudnn_train.kernels"""
