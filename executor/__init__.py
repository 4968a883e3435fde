"""tvmpipe.executor"""
