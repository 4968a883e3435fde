"""tvmpipe.examples"""
