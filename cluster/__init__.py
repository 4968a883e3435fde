"""tvmpipe.cluster"""
