"""tvmpipe.partition"""
