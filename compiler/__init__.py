"""tvmpipe.compiler"""
