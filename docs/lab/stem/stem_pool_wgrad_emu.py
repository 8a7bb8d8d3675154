# The pool form's window gather (pool_prologue, cuda/kernels/stem_conv_wgmma.cu) against
# pool_relu_apply_kernel's (for_each_pool_relu_grad): for each output pixel of each tile, the same
# windows (pool outputs) with the same position k, in the same order; and the windows the tile
# copies cover every one it reads.
kTileH,kTileW=8,16; kWinRows,kWinCols=kTileH//2+1,kTileW//2+1
def ref(h,w,OH,OW):
    a,b=h//2,w//2; dh,dw=h&1,w&1; out=[]
    for q in range(4):
        qh,qw=q>>1,q&1
        oh,ow=a+qh,b+qw
        if not(oh<OH and ow<OW): continue
        if (qh and not dh) or (qw and not dw): continue
        k=(0 if qh else dh+1)*3+(0 if qw else dw+1)
        out.append((oh,ow,k))
    return out
def kern(oh0,ow0,tid,r,PH,PW):
    c,col=tid&7,tid>>3; dw=col&1; a0,b0=oh0>>1,ow0>>1; dh=r&1; out=[]
    for q in range(4):
        qh,qw=q>>1,q&1
        if (qh and not dh) or (qw and not dw): continue
        wr,wc=(r>>1)+qh,(col>>1)+qw
        if a0+wr>=PH or b0+wc>=PW: continue
        assert 0<=wr<kWinRows and 0<=wc<kWinCols
        k=(0 if qh else dh+1)*3+(0 if qw else dw+1)
        out.append((a0+wr,b0+wc,k))
    return out, (oh0+r, ow0+col)
n=0
for (OH,OW) in [(16,16),(24,32),(112,112),(16,32),(8,16)]:
    PH,PW=(OH-1)//2+1,(OW-1)//2+1
    # the pool's own window check: window (a,b) covers rows 2a-1..2a+1
    for oh0 in range(0,OH,kTileH):
        for ow0 in range(0,OW,kTileW):
            for tid in range(128):
                if (tid&7)!=0: continue
                for r in range(kTileH):
                    got,(h,w)=kern(oh0,ow0,tid,r,PH,PW)
                    want=ref(h,w,PH,PW)
                    assert got==want,(h,w,got,want)
                    for (a,b,k) in got:
                        assert 2*a-1<=h<=2*a+1 and 2*b-1<=w<=2*b+1
                        assert k==(h-2*a+1)*3+(w-2*b+1)
                    # every window covering (h,w) inside the pool is listed
                    cover=[(a,b) for a in range(PH) for b in range(PW) if 2*a-1<=h<=2*a+1 and 2*b-1<=w<=2*b+1]
                    assert sorted(cover)==sorted((a,b) for a,b,_ in got),(h,w)
                    n+=1
print("pixels checked",n)
