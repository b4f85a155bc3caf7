"""cudnn_train.moe"""
