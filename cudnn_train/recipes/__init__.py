"""cudnn_train.recipes"""
