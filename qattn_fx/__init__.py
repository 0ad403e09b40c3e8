"""qattn_fx"""
