"""tensor_manager"""
